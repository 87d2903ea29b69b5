"""flatparam: flatten parameters into one FlatParameter and shard it."""

from flatparam._version import __version__

__all__ = ["__version__"]
