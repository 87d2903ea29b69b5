"""torch's state-dict API for our wrappers too: ``get_state_dict``, ``set_state_dict``
and the model and optimizer halves of each.

* ``functions``: the public functions, and what does not depend on the kind of model
  (options, several optimizers, the flattened optimizer form, the checks);
* ``front_ends``: which code makes and takes torch's forms for each kind of model and
  optimizer ([Note: state-dict front ends]), torch's own functions for the rest;
* ``rank0_broadcast``: ``broadcast_from_rank0``, a full state dict sent from rank 0.

[Note: the state-dict API room's seams]
The front ends call the per-kind modules of ``ckpt._wrappers`` and nothing else of
ckpt but ``ckpt._comm``; ``ckpt.torch_compat`` installs ``functions`` under torch's
names, keeping torch's originals in ``front_ends.TORCH``.
"""
