"""The save and load protocol (``ckpt.save``, ``async_save``, ``load``, ``verify``), what
it needs beside the format, and the ``CheckpointManager``.

[Note: what crosses into the commit room]
From the wrappers room only the adapter registry (``to_state_dict``, ``apply_loaded``)
and ``adopt_saved_names``; from the format room the writer, layout, leases, manifest,
safe reader, and flat coordination's tables, plan, index and reads ([Note: flat
coordination] in ``_format/chunk_table.py``; the rounds themselves are here, in
``save_rounds`` and ``save_load``). Nothing here knows a wrapper kind: a new kind is a
new adapter.
"""
