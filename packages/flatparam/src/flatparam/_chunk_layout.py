"""How parameters are each cut along one dimension over ranks, and packed per rank.

The second layout of this package, beside :class:`~flatparam.ShardLayout`'s
flat one: every parameter stays a tensor of its own, split into one chunk per
rank along a dimension (per-parameter sharding, as FSDP2 and ``DTensor``'s
``Shard(dim)`` do), and a rank's chunks of a group of parameters are packed
into one buffer so that a single collective moves the whole group. Pure
arithmetic on shapes plus tensor helpers; no process group, no module.

[Note: chunk layout]
Parameter ``i`` of shape ``shape_i`` is cut along ``dim_i`` (size ``size_i``)
the way ``torch.chunk`` cuts it, into chunks of ``chunk_i`` rows::

    chunk_i        = ceil(size_i / world_size)
    rows_i(r)      = clamp(size_i - r * chunk_i, 0, chunk_i)   # rank r's real rows
    rank r holds   full_i.narrow(dim_i, r * chunk_i, rows_i(r))   # rows_i(r) may be 0

(the last ranks' chunks are short or empty when ``size_i`` does not divide).
Each rank keeps its chunk of every parameter in one *region*, parameter ``i``
in a *slot* padded to ``chunk_i`` rows::

    inner_i        = numel_i / size_i            # elements per row along dim_i
    slot_i         = chunk_i * inner_i
    offset_i       = slot_0 + ... + slot_{i-1}
    shard_numel    = slot_0 + ... + slot_{n-1}   # the same on every rank
    region_r[offset_i : offset_i + slot_i] = rank r's chunk of i, then zeros
    padded_numel   = world_size * shard_numel

so the regions all-gathered in rank order are one buffer ``gathered`` with
``gathered[r * shard_numel : (r + 1) * shard_numel] == region_r``, and a
buffer laid out the same way (every rank's region of a full gradient,
:meth:`ChunkLayout.pack_full`) reduce-scatters into each rank's region of
the sum. A parameter's full value is spread over ``world_size`` slots
``shard_numel`` elements apart, so it is rebuilt by a copy
(:meth:`ChunkLayout.unpack_gathered`), one strided copy for the whole group.

A chunk lies contiguous in its slot. For ``dim_i == 0`` the padding rows sit
after the real ones, so the real rows are a contiguous prefix of the slot
(``local_views``). For ``dim_i > 0`` padding rows would sit inside every
outer row, so the size must divide evenly there (as ``DTensor`` and FSDP2
require too); :meth:`ChunkLayout.build` refuses it otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from flatparam._shard import _as_int

__all__ = ["ChunkLayout"]


@dataclass(frozen=True)
class ChunkLayout:
    """Where each rank's chunk of each parameter lies: see [Note: chunk layout].

    Build one with :meth:`build`. Every "where" question of a per-parameter
    sharded group is answered here, so the code that gathers, reduces,
    checkpoints and reshards it agrees by construction.
    """

    shapes: tuple[tuple[int, ...], ...]  # full shape of each parameter, in group order
    dims: tuple[int, ...]  # the dimension each parameter is cut along (>= 0)
    world_size: int  # number of ranks (chunks per parameter), >= 1

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.dims):
            raise ValueError(
                f"ChunkLayout needs one dim per shape, got {len(self.shapes)} shapes and "
                f"{len(self.dims)} dims"
            )
        if self.world_size < 1:
            raise ValueError(f"ChunkLayout needs world_size >= 1, got {self.world_size}")
        for i, (shape, dim) in enumerate(zip(self.shapes, self.dims, strict=True)):
            if not shape:
                raise ValueError(
                    f"parameter {i} is a scalar (shape ()): a chunk layout cuts along a "
                    "dimension, so make it a 1-D tensor of one element"
                )
            if not 0 <= dim < len(shape):
                raise ValueError(
                    f"parameter {i} of shape {shape} cannot be cut along dim {dim}; "
                    f"pass a dim in [0, {len(shape)})"
                )
            if dim > 0 and shape[dim] % self.world_size != 0:
                raise ValueError(
                    f"parameter {i} of shape {shape} is cut along dim {dim}, whose size "
                    f"{shape[dim]} does not divide by {self.world_size} ranks: a chunk along "
                    "a dimension other than 0 must be even (its padding would not be "
                    "contiguous). Cut it along dim 0 or choose sizes that divide"
                )

    @classmethod
    def build(
        cls,
        shapes: Sequence[Sequence[int]],
        world_size: int,
        dims: Sequence[int] | None = None,
    ) -> ChunkLayout:
        """Layout for parameters of ``shapes`` over ``world_size`` ranks.

        ``dims`` (default all 0) may be negative, counted from the end as in
        ``Shard(dim)``.
        """
        full = tuple(
            tuple(_as_int("shapes", s, "ChunkLayout.build") for s in shape) for shape in shapes
        )
        raw = (
            [0] * len(full)
            if dims is None
            else [_as_int("dims", d, "ChunkLayout.build") for d in dims]
        )
        if len(raw) != len(full):
            raise ValueError(
                f"ChunkLayout.build needs one dim per shape, got {len(full)} shapes "
                f"and {len(raw)} dims"
            )
        fixed = tuple(d + len(s) if d < 0 else d for d, s in zip(raw, full, strict=True))
        return cls(full, fixed, _as_int("world_size", world_size, "ChunkLayout.build"))

    # --- sizes -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.shapes)

    @cached_property
    def _chunks(self) -> tuple[int, ...]:
        return tuple(
            -(-shape[dim] // self.world_size)
            for shape, dim in zip(self.shapes, self.dims, strict=True)
        )

    @cached_property
    def _inners(self) -> tuple[int, ...]:
        # Elements per row along the cut dimension (also when that dimension is empty).
        return tuple(
            math.prod(s for j, s in enumerate(shape) if j != dim)
            for shape, dim in zip(self.shapes, self.dims, strict=True)
        )

    @cached_property
    def _offsets(self) -> tuple[int, ...]:
        offsets = [0]
        for i in range(len(self.shapes)):
            offsets.append(offsets[-1] + self.slot_numel(i))
        return tuple(offsets)

    def chunk_rows(self, i: int) -> int:
        """Rows along ``dims[i]`` of every rank's (padded) chunk of parameter ``i``."""
        return self._chunks[i]

    def slot_numel(self, i: int) -> int:
        """Elements of parameter ``i``'s padded slot in a region."""
        return self._chunks[i] * self._inners[i]

    def offset(self, i: int) -> int:
        """Where parameter ``i``'s slot starts inside a region."""
        return self._offsets[i]

    @property
    def shard_numel(self) -> int:
        """Elements of every rank's region (all slots, padding included)."""
        return self._offsets[-1]

    @property
    def padded_numel(self) -> int:
        """Elements of the gathered buffer: ``world_size * shard_numel``."""
        return self.world_size * self.shard_numel

    def numel(self, i: int) -> int:
        """Elements of parameter ``i``'s full tensor."""
        return math.prod(self.shapes[i])

    def rows(self, i: int, rank: int) -> tuple[int, int]:
        """``[start, end)`` along ``dims[i]`` of the rows ``rank`` holds of parameter ``i``."""
        self._check_rank(rank)
        size = self.shapes[i][self.dims[i]]
        start = min(rank * self._chunks[i], size)
        return start, min(start + self._chunks[i], size)

    def local_shape(self, i: int, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s chunk of parameter ``i`` (``DTensor``'s local shape)."""
        start, end = self.rows(i, rank)
        shape = list(self.shapes[i])
        shape[self.dims[i]] = end - start
        return tuple(shape)

    def padded_local_shape(self, i: int) -> tuple[int, ...]:
        """Shape of parameter ``i``'s slot: the chunk with its padding rows."""
        shape = list(self.shapes[i])
        shape[self.dims[i]] = self._chunks[i]
        return tuple(shape)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank} is out of range for world_size {self.world_size}; "
                f"pass a rank in [0, {self.world_size})"
            )

    # --- tensors ---------------------------------------------------------------------------

    def local_views(self, region: Tensor, rank: int) -> list[Tensor]:
        """``rank``'s chunk of every parameter as a view into ``region``.

        Each view is contiguous, of :meth:`local_shape`, and writes through to
        ``region``: a rank's sharded parameters can live in one buffer, which
        then is the all-gather's input as it is.
        """
        self._check_region(region, self.shard_numel, "local_views")
        out: list[Tensor] = []
        for i in range(len(self.shapes)):
            slot = region.narrow(0, self._offsets[i], self.slot_numel(i))
            chunk = slot.view(self.padded_local_shape(i))
            start, end = self.rows(i, rank)
            out.append(chunk.narrow(self.dims[i], 0, end - start))
        return out

    def shard(self, full: Sequence[Tensor], rank: int, out: Tensor | None = None) -> Tensor:
        """``rank``'s region of the full tensors ``full`` (padding zeroed), in ``out``.

        ``out`` (``shard_numel`` elements) is allocated like ``full[0]`` when
        not given. Not differentiable; for construction and loading.
        """
        self._check_full(full, "shard")
        if out is None:
            out = full[0].new_empty(self.shard_numel) if full else torch.empty(0)
        self._check_region(out, self.shard_numel, "shard")
        with torch.no_grad():
            for i, (t, view) in enumerate(zip(full, self.local_views(out, rank), strict=True)):
                start, end = self.rows(i, rank)
                view.copy_(t.narrow(self.dims[i], start, end - start))
                slot = out.narrow(0, self._offsets[i], self.slot_numel(i))
                slot.narrow(0, view.numel(), slot.numel() - view.numel()).zero_()
        return out

    def gathered_views(self, gathered: Tensor) -> list[Tensor]:
        """Parameter ``i``'s slots in every rank's region of ``gathered``, as ``(world_size,
        slot_i)`` strided views (not contiguous: rows are ``shard_numel`` apart)."""
        self._check_region(gathered, self.padded_numel, "gathered_views")
        rows = gathered.view(self.world_size, self.shard_numel)
        return [rows.narrow(1, self._offsets[i], self.slot_numel(i)) for i in range(len(self))]

    def unpack_gathered(self, gathered: Tensor, outs: Sequence[Tensor]) -> None:
        """Copy-out: every full parameter from the gathered regions, into ``outs``.

        ``outs[i]`` is a 1-D buffer of ``world_size * slot_numel(i)`` elements
        (the full parameter with its padding rows, see :meth:`full_view`),
        possibly of another dtype than ``gathered`` (a cast on the way). One
        strided copy for the group, plus one for each parameter cut along a
        dimension other than 0.
        """
        if len(outs) != len(self.shapes):
            raise ValueError(f"unpack_gathered needs {len(self.shapes)} outputs, got {len(outs)}")
        rows = gathered.view(self.world_size, self.shard_numel)
        views = []
        for i, out in enumerate(outs):
            self._check_region(out, self.world_size * self.slot_numel(i), "unpack_gathered")
            views.append(out.view(self.world_size, self.slot_numel(i)))
        dim0 = [i for i in range(len(self)) if self.dims[i] == 0]
        if len(dim0) == len(self) and all(o.dtype == gathered.dtype for o in outs):
            sizes = [self.slot_numel(i) for i in range(len(self))]
            torch.split_with_sizes_copy(rows, sizes, dim=1, out=views)
            return
        for i, (view, src) in enumerate(zip(views, self.gathered_views(gathered), strict=True)):
            if self.dims[i] == 0:
                view.copy_(src)
            else:
                # Rank r's chunk is rows [r * chunk, (r + 1) * chunk) along dims[i]: cat them.
                chunks = src.unbind(0)
                local = self.padded_local_shape(i)
                target = self.full_view(i, out=outs[i])
                torch.cat([c.view(local) for c in chunks], dim=self.dims[i], out=target)

    def full_view(self, i: int, out: Tensor) -> Tensor:
        """Parameter ``i``'s full tensor inside its padded buffer (see :meth:`unpack_gathered`):
        the first ``numel(i)`` elements, of the full shape (padding rows dropped)."""
        return out.narrow(0, 0, self.numel(i)).view(self.shapes[i])

    def pack_full(self, full: Sequence[Tensor], out: Tensor) -> None:
        """Every rank's region of the full tensors ``full`` into ``out`` (``padded_numel``).

        The reduce-scatter's input laid out as the gathered buffer is: after a
        reduce-scatter each rank holds its own region of the sum. Casts to
        ``out``'s dtype on the way; padding is zero.
        """
        self._check_full(full, "pack_full")
        self._check_region(out, self.padded_numel, "pack_full")
        tensors = []
        for i, t in enumerate(full):
            if t.numel() == 0:
                continue  # an empty slot (torch._chunk_cat refuses empty tensors)
            if self.dims[i] != 0 and self.world_size > 1:
                # Bring each rank's chunk together as the rows of a dim-0 chunk.
                tensors.append(torch.cat(torch.chunk(t, self.world_size, dim=self.dims[i])))
            else:
                tensors.append(t)
        if not tensors:
            return
        if len({t.dtype for t in tensors}) > 1:
            # torch._chunk_cat casts only one common input dtype: bring mixed ones
            # (a low-precision gradient beside a zero slot) to ``out``'s first.
            tensors = [t.to(out.dtype) for t in tensors]
        rows = out.view(self.world_size, self.shard_numel)
        torch._chunk_cat(tensors, 0, self.world_size, out=rows)

    def _check_full(self, full: Sequence[Tensor], fn: str) -> None:
        if len(full) != len(self.shapes):
            raise ValueError(f"{fn} needs {len(self.shapes)} tensors, got {len(full)}")
        for i, t in enumerate(full):
            if tuple(t.shape) != self.shapes[i]:
                raise ValueError(
                    f"{fn}: tensor {i} has shape {tuple(t.shape)}, the layout was built for "
                    f"{self.shapes[i]}"
                )

    @staticmethod
    def _check_region(t: Tensor, numel: int, fn: str) -> None:
        if t.dim() != 1 or t.numel() != numel:
            raise ValueError(
                f"{fn} needs a 1-D tensor of {numel} elements for this layout, got shape "
                f"{tuple(t.shape)}"
            )
