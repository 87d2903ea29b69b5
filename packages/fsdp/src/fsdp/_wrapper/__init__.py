"""``FullyShardedDataParallel``'s front end: the module wrapper over the shared runtime.

A wrapped module's parameters are flattened into one ``FlatParameter`` per unit
(``_flat_param_unit.py``, over ``_runtime/_sharded_storage.py``); the hooks that decide
when a unit gathers and reduces are in ``_fsdp_state.py``; construction in ``_init.py``
(with ``_process_groups.py``, ``_ignored.py``, ``_deferred_init.py``); the original
parameters under ``use_orig_params=True`` in ``_orig_params.py``; ``summon_full_params``,
state dicts, ``clip_grad_norm_`` and the memory estimate in their own modules. The
public class is ``fsdp.FullyShardedDataParallel`` (``fully_sharded_data_parallel.py``).
"""
