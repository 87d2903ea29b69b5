"""The runtime both front ends run on: ``FullyShardedDataParallel`` (``_wrapper/``) and
``fully_shard`` (``_fully_shard/``).

- ``_sharded_storage.py``: one rank's shard, its all-gather (cast, host copy) and the
  reduction of its gradient ([Note: sharded storage]);
- ``_collectives.py``: the collectives, stateless (gloo's composed sharded ones too);
- ``_replica_shard.py``: sharding across replicas, the shard of a replica gathered
  across replicas from the world shards ([Note: sharding across replicas]);
- ``_streams.py``: which CUDA stream runs what, and the events between them;
- ``_root_context.py``: what every unit under one root shares at run time (the
  order for issuing gathers ahead, the rate limiter, reductions in flight);
- ``_exec_order.py``: that order, as pure bookkeeping;
- ``_collective_failure.py``: backend failures renamed with the rank, unit and phase;
- ``_device.py``, ``_common.py``: the CUDA device choice, nested-tensor helpers.

Nothing here knows which front end it serves; the front ends import from here,
never the other way round.
"""
