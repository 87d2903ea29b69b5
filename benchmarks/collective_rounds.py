"""Count the collective rounds a block of code makes, and the bytes this rank puts in.

A round is one call of a ``torch.distributed`` primitive (all-gather, gather,
broadcast, scatter, all-to-all, all-reduce, barrier, ...), wherever it comes from: an
object collective (``all_gather_object`` is two rounds: the sizes, then the bytes),
DCP's planning, a wrapper's own all-gathers. While :func:`counting` is active every
primitive is replaced, in ``torch.distributed`` and in ``distributed_c10d`` (whose
object collectives call them by their module names), by one that counts it and the
bytes of the tensors this rank contributes: its input of an all-gather, gather,
all-to-all or all-reduce, the tensor of a broadcast or the list of a scatter when this
rank is the source. A primitive called inside another is not counted twice.

``tests/ckpt/test_flat_coordination.py`` counts ckpt's rounds with it, and ``bench_ckpt_scale``
ckpt's and DCP's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["Rounds", "counting"]

_PRIMITIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
)


@dataclass
class Rounds:
    """What :func:`counting` saw: rounds by primitive, and the bytes this rank sent."""

    calls: dict[str, int]
    sent: int = 0

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def _nbytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _sent(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The bytes this rank contributes to one primitive call."""
    import torch.distributed as dist

    def arg(i: int, key: str) -> Any:
        return args[i] if len(args) > i else kwargs.get(key)

    if name in ("broadcast", "scatter"):
        src = arg(1 if name == "broadcast" else 2, "src")
        group_src = kwargs.get("group_src")
        group = kwargs.get("group")
        if group_src is not None and group_src != dist.get_rank(group):
            return 0
        if src is not None and src != dist.get_rank():
            return 0
        return _nbytes(arg(0, "tensor") if name == "broadcast" else arg(1, "scatter_list"))
    if name in ("all_gather", "gather"):
        return _nbytes(arg(1, "tensor") if name == "all_gather" else arg(0, "tensor"))
    if name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return _nbytes(arg(1, "input_tensor"))
    if name in ("all_to_all_single", "all_to_all"):
        single = name == "all_to_all_single"
        return _nbytes(arg(1, "input") if single else arg(1, "input_tensor_list"))
    if name in ("all_reduce", "reduce", "send"):
        return _nbytes(arg(0, "tensor"))
    return 0


@contextmanager
def counting() -> Iterator[Rounds]:
    """Count every primitive collective the block makes (this thread and others)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    found = Rounds({})
    inside = threading.local()
    lock = threading.Lock()
    originals: dict[str, Callable[..., Any]] = {}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(inside, "depth", 0):
                return fn(*args, **kwargs)
            with lock:
                found.calls[name] = found.calls.get(name, 0) + 1
                found.sent += _sent(name, args, kwargs)
            inside.depth = 1
            try:
                return fn(*args, **kwargs)
            finally:
                inside.depth = 0

        return call

    for name in _PRIMITIVES:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        originals[name] = original
        wrapper = counted(name, original)
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)
    try:
        yield found
    finally:
        for name, original in originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
