"""``python -m ckpt``: the ``ckpt`` program (see ``ckpt --help``)."""

from ckpt._tools.cli import console_main

if __name__ == "__main__":
    console_main()
