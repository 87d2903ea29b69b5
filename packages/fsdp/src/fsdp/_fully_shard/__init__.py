"""``fully_shard``'s front end (FSDP2's API) over the shared runtime.

- ``_api.py``: ``fully_shard``, ``FSDPModule``, ``UnshardHandle``,
  ``register_fsdp_forward_method`` (the public surface);
- ``_policies.py``: ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy``;
- ``_state.py``: the hooks of one ``fully_shard`` call and the root's lazy init;
- ``_param_group.py``: a call's parameters as parts, each one
  ``ShardedStorage`` (``_runtime/``) over a ``flatparam.ChunkLayout``;
- ``_param.py``: one parameter's ``DTensor`` shard and unsharded leaf;
- ``_mesh.py``: the ``DeviceMesh`` and its groups.
"""
