"""Taking state out of each kind of model and optimizer, and putting it back: FSDP1
(``fsdp1_*``), ``fully_shard`` and other ``DTensor`` models (``fully_shard``), ZeRO
(``zero``); plain modules and DDP need nothing of their own. What they share: FQNs
(``fqns``), the forms of an FQN-keyed optimizer state dict (``optim_dict_forms``), the
SHARDED layout (``sharded_chunks``), other tools' values (``loadable_values``).

[Note: what crosses into and out of the wrappers room]
Two callers, each through one seam: ``ckpt.save``/``load`` through ``adapters`` ([Note:
the adapter protocol]), torch's state-dict API through its front ends ([Note:
state-dict front ends]; the ``fully_shard`` one lives here, being all that module
does). Inward these modules use only ``ckpt._errors``, ``ckpt._comm`` and, from the
format room, ``FlatPieces`` and the manifest a load reads. fsdp's own state-dict
hooks arrive through ``ckpt.fsdp_methods``, which re-exports the FSDP1 functions here.
"""
