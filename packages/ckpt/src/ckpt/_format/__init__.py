"""The on-disk format and its integrity: what a checkpoint directory holds, how its
files are written (``writer``, ``flat_pieces``, ``save_planner``), committed
(``layout``) by one writer at a time (``lease``), checked (``manifest``,
``file_checks``, ``disk_space``) and read back without running code from it
(``safe_unpickling``, ``reader``).

[Note: the format room's floor]
Nothing here knows a model, an optimizer or a process group: it imports only
``ckpt._errors`` (and ``ckpt._version``). The commit room drives it, the tools read
through it, and the wrappers room hands it ``FlatPieces``.
"""
