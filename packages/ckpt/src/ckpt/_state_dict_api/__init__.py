"""torch's state-dict API for our wrappers too: ``get_state_dict``, ``set_state_dict``
and their model and optimizer halves, made and taken per kind by the front ends.

[Note: the state-dict API room's seams]
The front ends call the per-kind modules of ``ckpt._wrappers`` and, of the rest of
ckpt, only ``ckpt._comm``; ``ckpt.torch_compat`` installs ``functions`` under torch's
names, keeping torch's originals in ``front_ends.TORCH``.
"""
