"""Taking state out of each kind of model and optimizer, and putting it back: one
module, or a few named ``fsdp1_*``, per kind; plain modules and DDP need none.

[Note: what crosses into and out of the wrappers room]
Two callers, each through one seam: ``ckpt.save``/``load`` through ``adapters`` ([Note:
the adapter protocol]), torch's state-dict API through its front ends ([Note:
state-dict front ends]; the ``fully_shard`` one lives here, being all that module
does). Inward these modules use only ``ckpt._errors``, ``ckpt._comm`` and, from the
format room, ``FlatPieces`` and the manifest a load reads. fsdp's own state-dict
hooks arrive through ``ckpt.fsdp_methods``, which re-exports the FSDP1 functions here.
"""
