"""The save and load protocol (``save_load``: ``ckpt.save``, ``async_save``, ``load``,
``verify``) with what it needs beside the format: the host copy of an asynchronous
save (``staging``), the check that every rank makes the same call (``agreement``), the
fit of a checkpoint to the state it loads into (``load_fit``), faults of a peer named
(``peer_faults``); and the ``CheckpointManager`` (``manager``).

[Note: what crosses into the commit room]
From the wrappers room only the adapter registry (``to_state_dict``, ``apply_loaded``)
and ``adopt_saved_names``; from the format room the writer, layout, lease, manifest
and safe reader. Nothing here knows a wrapper kind: a new kind is a new adapter.
"""
