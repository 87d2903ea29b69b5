"""The save and load protocol (``ckpt.save``, ``async_save``, ``load``, ``verify``), what
it needs beside the format, and the ``CheckpointManager``.

[Note: what crosses into the commit room]
From the wrappers room only the adapter registry (``to_state_dict``, ``apply_loaded``)
and ``adopt_saved_names``; from the format room the writer, layout, lease, manifest
and safe reader. Nothing here knows a wrapper kind: a new kind is a new adapter.
"""
