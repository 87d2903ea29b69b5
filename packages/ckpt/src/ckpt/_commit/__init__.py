"""The save and load protocol: ``ckpt.save``, ``async_save``, ``load``, ``verify``, and
the ``CheckpointManager`` that numbers and rotates checkpoints.

* ``save_load``: a save as a transaction (lease, partial directory, DCP write, manifest,
  atomic commit: [Note: atomic commit]) and a load (verify, fit, read, apply);
* ``staging``: the host copy ``async_save`` blocks for ([Note: staging]);
* ``agreement``: the check that every rank makes the same call;
* ``load_fit``: whether a checkpoint's keys and shapes fit the state it loads into;
* ``peer_faults``: a peer that dies or hangs inside a save or load, named
  ([Note: naming a fault inside a checkpoint]);
* ``manager``: ``root/step_<N>`` checkpoints, rotation and the latest whole one.

[Note: what crosses into the commit room]
From the wrappers room only the adapter registry (``to_state_dict``, ``apply_loaded``:
[Note: the adapter protocol]) and ``adopt_saved_names`` (a tied parameter's saved
name); from the format room the writer, the layout, the lease, the manifest and the
safe reader. Nothing here knows a wrapper kind: a new kind of model is a new adapter,
not a change here.
"""
