"""zero_optim: see the package README; the public API lands with its issue."""

from zero_optim._version import __version__

__all__ = ["__version__"]
