"""How a flat tensor is split into equal, padded, aligned chunks over ranks.

Everything here is a pure function of sizes (and, for the tensor helpers, of the
tensor handed in): no process group, no module, no state. fsdp and zero_optim
build a :class:`ShardLayout` once and ask it where each rank's chunk lies and
which slices of which original parameters that chunk holds.

[Note: padding]
A flat tensor of ``full_numel`` elements (the original parameters concatenated
in order, parameter ``i`` at ``flat[offset_i : offset_i + numel_i]``) is split
into ``world_size`` chunks of one common length ``shard_numel``:

    shard_numel  = ceil(ceil(full_numel / world_size) / align_numel) * align_numel
    padded_numel = shard_numel * world_size          # >= full_numel
    rank r's chunk = padded[r * shard_numel : (r + 1) * shard_numel]

``padded`` is the flat tensor followed by ``padded_numel - full_numel`` zeros.
Equal chunks are what all-gather and reduce-scatter need, and making
``shard_numel`` a multiple of ``align_numel`` puts every chunk's first element
at the same byte alignment as the flat tensor's first element (see
:func:`align_numel_for`). All padding sits at the end of the padded tensor, so
it occupies the tail of the last rank(s): a rank's chunk is ``shard_numel -
num_padded(r)`` real elements followed by ``num_padded(r)`` zeros, and a rank
whose chunk starts at or past ``full_numel`` holds padding only. Dropping the
padding (``padded[:full_numel]``) gives back the flat tensor bit for bit.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

__all__ = [
    "ShardLayout",
    "ShardPiece",
    "align_numel_for",
    "pad_flat",
    "shard_flat",
    "unpad_flat",
    "unshard_flat",
]


@dataclass(frozen=True)
class ShardPiece:
    """One original parameter's slice that lies inside one rank's chunk.

    The slice is ``param.reshape(-1)[param_start:param_end]`` and it sits at
    ``chunk[shard_offset : shard_offset + numel]``; equivalently, in the flat
    tensor it is ``flat[rank_start + shard_offset : rank_start + shard_offset + numel]``.
    Pieces never include padding (see [Note: padding] in this module).
    """

    param_index: int  # index into the flat parameter's parameter list
    param_start: int  # element offset inside the flattened parameter, inclusive
    param_end: int  # element offset inside the flattened parameter, exclusive
    shard_offset: int  # where the slice starts inside the rank's chunk

    @property
    def numel(self) -> int:
        """Elements in the slice: ``param_end - param_start`` (always > 0)."""
        return self.param_end - self.param_start


@dataclass(frozen=True)
class ShardLayout:
    """How a flat tensor made of parameters of ``numels`` is split over ranks.

    One layout answers every "where" question fsdp and zero_optim ask about a
    sharded flat parameter, so they agree on it by construction: a rank's chunk
    bounds in the padded flat tensor (:meth:`bounds`), its padding
    (:meth:`num_padded`) and the original-parameter slices it holds
    (:meth:`pieces`). The arithmetic is in [Note: padding] at the top of this
    module. Build one with :meth:`build`; direct construction is validated the
    same way.
    """

    numels: tuple[int, ...]  # numel of each original parameter, in flat order
    world_size: int  # number of chunks (ranks), >= 1
    align_numel: int = 1  # shard_numel is a multiple of this, >= 1

    def __post_init__(self) -> None:
        if not isinstance(self.numels, tuple):
            raise TypeError(
                f"ShardLayout.numels must be a tuple of ints, got {type(self.numels).__name__}; "
                "use ShardLayout.build(numels, world_size), which accepts any sequence"
            )
        bad = [(i, n) for i, n in enumerate(self.numels) if not _is_int(n) or n < 0]
        if bad:
            raise ValueError(
                f"ShardLayout needs non-negative integer numels, got {bad[:5]} "
                "(index, numel); pass param.numel() for each parameter"
            )
        if not _is_int(self.world_size) or self.world_size < 1:
            raise ValueError(
                f"ShardLayout needs world_size >= 1, got {self.world_size!r}; "
                "pass the number of ranks the flat tensor is split over"
            )
        if not _is_int(self.align_numel) or self.align_numel < 1:
            raise ValueError(
                f"ShardLayout needs align_numel >= 1, got {self.align_numel!r}; "
                "use 1 for no alignment or align_numel_for(dtype, align_bytes)"
            )

    @classmethod
    def build(cls, numels: Sequence[int], world_size: int, align_numel: int = 1) -> ShardLayout:
        """Layout for parameters of ``numels`` over ``world_size`` ranks.

        Takes any sequence (a list from ``FlatParameter._param_numels``, a
        generator of ``p.numel()`` materialised by the caller) so that callers
        need not build the tuple that makes the layout hashable.
        """
        return cls(
            tuple(_as_int("numels", n) for n in numels),
            _as_int("world_size", world_size),
            _as_int("align_numel", align_numel),
        )

    @property
    def full_numel(self) -> int:
        """Elements of real data in the flat tensor: ``sum(numels)``."""
        return self._offsets[-1]

    @property
    def shard_numel(self) -> int:
        """Length of every rank's chunk, padding included (see [Note: padding])."""
        per_rank = -(-self.full_numel // self.world_size)
        return -(-per_rank // self.align_numel) * self.align_numel

    @property
    def padded_numel(self) -> int:
        """Length of the padded flat tensor: ``shard_numel * world_size``."""
        return self.shard_numel * self.world_size

    @cached_property
    def _offsets(self) -> tuple[int, ...]:
        # _offsets[i] is where parameter i starts in the flat tensor and
        # _offsets[-1] is full_numel: parameter i is flat[_offsets[i] : _offsets[i + 1]].
        offsets = [0]
        for n in self.numels:
            offsets.append(offsets[-1] + n)
        return tuple(offsets)

    def param_bounds(self, param_index: int) -> tuple[int, int]:
        """``[start, end)`` of parameter ``param_index`` in the flat tensor.

        The flat tensor stores parameter ``i`` at ``flat[start:end]``; this is the
        exclusive form of the seed's inclusive ``FlatParameter._param_offsets``.
        """
        if not 0 <= param_index < len(self.numels):
            raise IndexError(
                f"param_index {param_index} is out of range for a layout of "
                f"{len(self.numels)} parameters"
            )
        return self._offsets[param_index], self._offsets[param_index + 1]

    def _check_rank(self, rank: int) -> None:
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank!r} is out of range for world_size {self.world_size}; "
                f"pass a rank in [0, {self.world_size})"
            )

    def bounds(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s chunk in the padded flat tensor.

        ``end - start == shard_numel`` for every rank; the chunk may run past
        ``full_numel`` into padding (see [Note: padding]).
        """
        self._check_rank(rank)
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def data_numel(self, rank: int) -> int:
        """Real (non-padding) elements in ``rank``'s chunk: ``shard_numel - num_padded(rank)``."""
        start, end = self.bounds(rank)
        return max(0, min(end, self.full_numel) - start)

    def num_padded(self, rank: int) -> int:
        """Padding elements at the end of ``rank``'s chunk (see [Note: padding])."""
        return self.shard_numel - self.data_numel(rank)

    def pieces(self, rank: int) -> tuple[ShardPiece, ...]:
        """The original-parameter slices ``rank``'s chunk holds, in flat order.

        Over all ranks the pieces cover every element of every parameter exactly
        once; zero-numel parameters have no elements and so no pieces. Within a
        rank, pieces are contiguous: piece ``k + 1`` starts in the chunk where
        piece ``k`` ends, and the last one ends at ``data_numel(rank)``.
        """
        start, end = self.bounds(rank)
        out: list[ShardPiece] = []
        for i, n in enumerate(self.numels):
            p_start = self._offsets[i]
            lo = max(start, p_start)
            hi = min(end, p_start + n)
            if lo < hi:
                out.append(ShardPiece(i, lo - p_start, hi - p_start, lo - start))
        return tuple(out)

    def ranks_of(self, param_index: int) -> range:
        """The ranks whose chunks hold some of parameter ``param_index``.

        Empty for a zero-numel parameter. Useful to know which ranks must take part
        in rebuilding one parameter (e.g. an optimizer state entry).
        """
        p_start, p_end = self.param_bounds(param_index)
        if p_start == p_end:
            return range(0)
        return range(p_start // self.shard_numel, (p_end - 1) // self.shard_numel + 1)


def _as_int(name: str, value: object, fn: str = "ShardLayout.build") -> int:
    """``value`` as an int if it is an integer (int, numpy or 0-dim integer tensor).

    A float or a string is refused rather than truncated: ``world_size=2.5``
    is a mistake, not a request for 2 ranks.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{fn}: {name} must be an integer, got {value!r} ({type(value).__name__}); pass an int"
        ) from None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def align_numel_for(dtype: torch.dtype, align_bytes: int) -> int:
    """Smallest element count whose byte size is a multiple of ``align_bytes``.

    Pass the result as ``align_numel`` so that every rank's chunk starts
    ``align_bytes``-aligned relative to the flat tensor (16 bytes suits
    vectorised kernels and NCCL). An alignment finer than the element size costs
    nothing: ``align_numel_for(torch.float64, 4) == 1``.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"align_numel_for needs a torch.dtype, got {type(dtype).__name__}")
    if not _is_int(align_bytes) or align_bytes < 1:
        raise ValueError(
            f"align_bytes must be a positive int, got {align_bytes!r}; use 1 for no alignment"
        )
    itemsize = dtype.itemsize
    return align_bytes // math.gcd(align_bytes, itemsize)


def _check_flat(flat: Tensor, numel: int, what: str, fn: str) -> None:
    if flat.dim() != 1:
        raise ValueError(
            f"{fn} needs a 1-D tensor, got shape {tuple(flat.shape)}; flatten it with .reshape(-1)"
        )
    if flat.numel() != numel:
        raise ValueError(
            f"{fn} needs a tensor of {what} = {numel} elements for this layout, "
            f"got {flat.numel()}; was the layout built for another flat tensor?"
        )


def shard_flat(flat: Tensor, layout: ShardLayout, rank: int) -> Tensor:
    """A new tensor holding ``rank``'s chunk of ``flat``, zero padding included.

    ``flat`` is the unpadded flat tensor (``full_numel`` elements); the result
    has ``shard_numel`` elements and shares no storage with ``flat``, so the
    caller may free or resize ``flat`` afterwards. Differentiable.
    """
    _check_flat(flat, layout.full_numel, "full_numel", "shard_flat")
    start, _ = layout.bounds(rank)
    n = layout.data_numel(rank)
    data = flat.narrow(0, min(start, layout.full_numel), n)
    return torch.cat([data, flat.new_zeros(layout.num_padded(rank))])


def pad_flat(flat: Tensor, layout: ShardLayout) -> Tensor:
    """A new tensor of ``padded_numel`` elements: ``flat`` then zero padding.

    This is the buffer that all-gather fills and reduce-scatter reads; rank
    ``r``'s chunk is ``padded[layout.bounds(r)[0] : layout.bounds(r)[1]]``.
    """
    _check_flat(flat, layout.full_numel, "full_numel", "pad_flat")
    return torch.cat([flat, flat.new_zeros(layout.padded_numel - layout.full_numel)])


def unpad_flat(padded: Tensor, layout: ShardLayout) -> Tensor:
    """A view of the first ``full_numel`` elements of ``padded``: padding dropped.

    A view rather than a copy so that unsharded parameter views can alias the
    all-gather output buffer.
    """
    _check_flat(padded, layout.padded_numel, "padded_numel", "unpad_flat")
    return padded.narrow(0, 0, layout.full_numel)


def unshard_flat(chunks: Sequence[Tensor], layout: ShardLayout) -> Tensor:
    """The flat tensor rebuilt from every rank's chunk, in rank order.

    The single-process inverse of :func:`shard_flat`: ``unshard_flat([shard_flat(
    flat, layout, r) for r in range(world_size)], layout)`` equals ``flat``
    bit for bit. The result has ``full_numel`` elements and shares no storage
    with ``chunks``.
    """
    if len(chunks) != layout.world_size:
        raise ValueError(
            f"unshard_flat needs one chunk per rank ({layout.world_size}), got {len(chunks)}"
        )
    for r, chunk in enumerate(chunks):
        if chunk.dim() != 1 or chunk.numel() != layout.shard_numel:
            raise ValueError(
                f"unshard_flat: chunk {r} has shape {tuple(chunk.shape)}, expected "
                f"({layout.shard_numel},) (shard_numel); pass shard_flat's outputs"
            )
    return torch.cat(list(chunks)).narrow(0, 0, layout.full_numel)
