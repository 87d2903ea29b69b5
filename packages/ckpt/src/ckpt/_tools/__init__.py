"""The tools around checkpoints: the ``ckpt`` program, ``export``, ``load_pretrained``.

[Note: the tools read through the format room]
Every tool reads a checkpoint through ``ckpt._format`` (``CheckpointReader``, the
manifest, the file checks), so nothing from a checkpoint is run here either; none of
them imports the commit or the wrappers room.
"""
