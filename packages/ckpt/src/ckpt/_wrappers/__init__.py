"""Taking state out of each kind of model and optimizer, and putting it back.

One module, or a few named by the wrapper they serve, per kind:

* FSDP1 (``fsdp.FullyShardedDataParallel``, either ``use_orig_params``):
  ``fsdp1_model`` (the model's state dicts under each state-dict type, selected with
  ``fsdp1_state_dict_type``), ``fsdp1_optim`` and ``fsdp1_orig_params_optim`` (its
  optimizer's state per original parameter), ``fsdp1_runs`` (the runs of each
  parameter a rank holds, what ``ckpt.save`` writes) and ``fsdp1_unit_exchange`` (a
  unit's flat shards rearranged into SHARDED chunks and back, without a gather);
* ``fully_shard`` (FSDP2 and any model with ``DTensor`` parameters);
* ``zero`` (``zero_optim.ZeroRedundancyOptimizer``);
* plain modules and DDP need nothing of their own: torch's functions serve them.

Shared by them: ``fqns`` (parameter names as torch's state-dict API gives them, tied
parameters included), ``optim_dict_forms`` (the nested and flattened forms of an
FQN-keyed optimizer state dict), ``sharded_chunks`` (the SHARDED layout: dimension-0
chunks as ``DTensor`` s), ``loadable_values`` (``ShardedTensor`` s and tensor-likes
made loadable), and ``optim_state`` (``ckpt.optim_state_dict``: one call for any of
the optimizers above).

[Note: what crosses into and out of the wrappers room]
Two callers use these modules, each through one seam:

* ``ckpt.save``/``ckpt.load`` (``ckpt._commit``) through ``adapters``: a registry of
  :class:`~ckpt._wrappers.adapters.StateAdapter` s, one per kind, that turn each object
  of a save's ``state`` into the dict DCP writes and back ([Note: the adapter
  protocol]);
* torch's state-dict API (``ckpt._state_dict_api``) through its front ends, which call
  the per-kind functions here ([Note: state-dict front ends]).

Inward, these modules use only ``ckpt._errors``, ``ckpt._comm`` (the object
collectives) and, from the format room, ``FlatPieces`` (how a rank's runs are written)
and the manifest a load reads. fsdp's own state-dict hooks come in through
``ckpt.fsdp_methods``, which re-exports the FSDP1 functions here.
"""
