"""The memory tier: snapshots of the training state in host memory, replicated on
another machine, and the resume that prefers them (see ``snapshots.py``)."""
