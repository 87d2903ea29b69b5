"""fsdp: see the package README; the public API lands with its issue."""

from fsdp._version import __version__

__all__ = ["__version__"]
