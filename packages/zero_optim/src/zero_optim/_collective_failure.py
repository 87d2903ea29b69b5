"""Backend failures of ZeroRedundancyOptimizer's collectives, re-raised named.

A broadcast of updated parameters or a gather of optimizer state fails when a
peer died, is in another collective, or is late beyond the process group's
timeout; :func:`collective_failures` turns the backend's ``RuntimeError`` into
:class:`~flatparam.CollectiveError` (rank, operation, what it moved, phase),
chained to it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from flatparam import CollectiveError

__all__ = ["collective_failures"]


@contextmanager
def collective_failures(rank: int, operation: str, target: str, phase: str) -> Iterator[None]:
    """Re-raise a backend ``RuntimeError`` inside the block as a :class:`CollectiveError`."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:  # torch's DistError/DistBackendError derive from it
        raise CollectiveError.from_backend(
            e, rank=rank, operation=operation, target=target, phase=phase
        ) from e
