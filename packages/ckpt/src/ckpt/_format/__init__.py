"""The on-disk format and its integrity: what a checkpoint directory holds, how its
files are written, checked and read back, and who may write it.

* ``layout``: where a checkpoint's files live before, during and after its commit
  (the partial directory, the atomic rename: [Note: atomic commit]);
* ``lease`` and ``processes``: one writer per checkpoint, and who that writer is;
* ``writer``: DCP's file writer that hashes as it writes, ``disk_space`` its full-disk
  checks;
* ``manifest`` and ``file_checks``: every file's size and checksum, and the cheap and
  the full checks against them ([Note: integrity]);
* ``flat_pieces`` and ``save_planner``: how an fsdp rank's runs of a parameter are
  written as they lie ([Note: flat pieces]);
* ``safe_unpickling`` and ``reader``: reading it all back without running code from
  the checkpoint ([Note: no code from a checkpoint]).

[Note: the format room's floor]
Nothing here knows a model, an optimizer or a process group: it imports only
``ckpt._errors`` (and ``ckpt._version`` for the manifest). The save and load protocol
(``ckpt._commit``) drives it; the tools (``ckpt._tools``) read through it; the
wrapper modules (``ckpt._wrappers``) hand it ``FlatPieces``.
"""
