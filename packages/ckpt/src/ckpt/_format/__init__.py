"""The on-disk format and its integrity: how a checkpoint's files are written,
committed by one writer at a time, checked, and read back without running code.

[Note: the format room's floor]
Nothing here knows a model or an optimizer, and nothing here makes a collective: it
imports only ``ckpt._errors`` (and ``ckpt._version``). A ``DTensor``'s mesh is read
for this rank's box of it (``chunk_table``), never communicated over. The commit room
drives it, the tools read through it, and the wrappers room hands it ``FlatPieces``.
"""
