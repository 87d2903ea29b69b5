"""The tools around checkpoints, none of which needs a process group of its own:

* ``cli``: the ``ckpt`` program (``ls``, ``inspect``, ``verify``, ``export``; also
  ``python -m ckpt``), with ``json_values`` for its ``--json`` output;
* ``export``: a checkpoint's model weights as safetensors or ``torch.save`` files;
* ``pretrained``: ``ckpt.load_pretrained``, safetensors weights into a sharded model.

[Note: the tools read through the format room]
Every tool reads a checkpoint through ``ckpt._format`` (``CheckpointReader``, the
manifest, the file checks), so nothing from a checkpoint is run here either ([Note: no
code from a checkpoint]); none of them imports the commit or the wrappers room.
"""
