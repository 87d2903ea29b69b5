"""ckpt: see the package README; the public API lands with its issue."""

from ckpt._version import __version__

__all__ = ["__version__"]
