"""ChunkLayout: per-parameter chunks packed per rank; pure, single process.

The reference for every helper is the obvious definition: ``torch.chunk`` of each
parameter along its dimension, rank ``r`` taking chunk ``r`` (or nothing), and
DTensor's ``Shard(dim)`` local shapes (``torch.distributed.tensor``'s own
arithmetic, run without a process group).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

from flatparam import ChunkLayout


def _params(shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def _chunk(t: torch.Tensor, world: int, dim: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(t, world, dim=dim)
    if rank < len(chunks):
        return chunks[rank]
    shape = list(t.shape)
    shape[dim] = 0
    return t.new_empty(shape)


shapes_st = st.lists(
    st.lists(st.integers(min_value=0, max_value=7), min_size=1, max_size=3).map(tuple),
    min_size=1,
    max_size=5,
)


def test_worked_example() -> None:
    # weight (5, 2) and bias (5,) over 4 ranks: chunks of 2 rows, rank 3 holds nothing.
    layout = ChunkLayout.build([(5, 2), (5,)], 4)
    assert [layout.chunk_rows(i) for i in range(2)] == [2, 2]
    assert [layout.slot_numel(i) for i in range(2)] == [4, 2]
    assert [layout.offset(i) for i in range(2)] == [0, 4]
    assert layout.shard_numel == 6 and layout.padded_numel == 24
    assert [layout.local_shape(0, r) for r in range(4)] == [(2, 2), (2, 2), (1, 2), (0, 2)]
    assert layout.rows(1, 3) == (5, 5)
    w, b = torch.arange(10.0).view(5, 2), torch.arange(5.0) + 100
    region = layout.shard([w, b], 2)
    assert region.tolist() == [8.0, 9.0, 0.0, 0.0, 104.0, 0.0]


@settings(max_examples=60, deadline=None)
@given(shapes=shapes_st, world=st.integers(min_value=1, max_value=5))
def test_local_shapes_are_dtensor_shard0(shapes: list[tuple[int, ...]], world: int) -> None:
    layout = ChunkLayout.build(shapes, world)
    for i, shape in enumerate(shapes):
        for r in range(world):
            expected, _ = Shard(0)._local_shard_size_and_offset(shape[0], world, r)
            assert layout.local_shape(i, r)[0] == expected
            assert layout.local_shape(i, r)[1:] == shape[1:]


@settings(max_examples=60, deadline=None)
@given(shapes=shapes_st, world=st.integers(min_value=1, max_value=5))
def test_shard_views_gather_unpack_roundtrip(shapes: list[tuple[int, ...]], world: int) -> None:
    layout = ChunkLayout.build(shapes, world)
    params = _params(shapes)
    regions = [layout.shard(params, r) for r in range(world)]
    for r, region in enumerate(regions):
        for i, view in enumerate(layout.local_views(region, r)):
            assert view.is_contiguous()
            torch.testing.assert_close(view, _chunk(params[i], world, 0, r), rtol=0, atol=0)
            assert view.numel() == 0 or view.data_ptr() >= region.data_ptr()
    gathered = torch.cat(regions)  # what an all-gather of the regions produces
    outs = [torch.full((world * layout.slot_numel(i),), float("nan")) for i in range(len(shapes))]
    layout.unpack_gathered(gathered, outs)
    for i, p in enumerate(params):
        assert torch.equal(layout.full_view(i, outs[i]), p)


@settings(max_examples=60, deadline=None)
@given(shapes=shapes_st, world=st.integers(min_value=1, max_value=5))
def test_pack_full_is_every_rank_region(shapes: list[tuple[int, ...]], world: int) -> None:
    layout = ChunkLayout.build(shapes, world)
    grads = _params(shapes, seed=1)
    packed = torch.full((layout.padded_numel,), float("nan"))
    layout.pack_full(grads, packed)
    expected = torch.cat([layout.shard(grads, r) for r in range(world)])
    assert torch.equal(packed, expected)


def test_pack_full_casts() -> None:
    layout = ChunkLayout.build([(3, 2)], 2)
    g = torch.randn(3, 2, dtype=torch.bfloat16)
    out = torch.empty(layout.padded_numel, dtype=torch.float32)
    layout.pack_full([g], out)
    assert torch.equal(out, torch.cat([layout.shard([g.float()], r) for r in range(2)]))


def test_pack_full_casts_mixed_dtypes() -> None:
    """A bf16 gradient beside an fp32 zero slot (a group part of whose parameters
    had no gradient in this backward) packs into the fp32 buffer."""
    layout = ChunkLayout.build([(3, 2), (5,)], 2)
    g = torch.randn(3, 2, dtype=torch.bfloat16)
    z = torch.zeros(5)
    out = torch.empty(layout.padded_numel, dtype=torch.float32)
    layout.pack_full([g, z], out)
    expected = torch.cat([layout.shard([g.float(), z], r) for r in range(2)])
    assert torch.equal(out, expected)


def test_other_dims_even() -> None:
    shapes = [(3, 4), (2, 6, 2)]
    layout = ChunkLayout.build(shapes, 2, dims=[1, -2])
    assert layout.dims == (1, 1)
    params = _params(shapes)
    regions = [layout.shard(params, r) for r in range(2)]
    for r in range(2):
        for i, view in enumerate(layout.local_views(regions[r], r)):
            assert view.is_contiguous()
            assert torch.equal(view, _chunk(params[i], 2, 1, r))
    outs = [torch.empty(2 * layout.slot_numel(i)) for i in range(2)]
    layout.unpack_gathered(torch.cat(regions), outs)
    for i, p in enumerate(params):
        assert torch.equal(layout.full_view(i, outs[i]), p)
    packed = torch.empty(layout.padded_numel)
    layout.pack_full(params, packed)
    assert torch.equal(packed, torch.cat(regions))


def test_unpack_casts_mixed_dims() -> None:
    shapes = [(5, 2), (2, 4)]
    layout = ChunkLayout.build(shapes, 2, dims=[0, 1])
    params = [p.to(torch.bfloat16) for p in _params(shapes)]
    gathered = torch.cat([layout.shard(params, r) for r in range(2)])
    outs = [torch.empty(2 * layout.slot_numel(i), dtype=torch.float32) for i in range(2)]
    layout.unpack_gathered(gathered, outs)
    for i, p in enumerate(params):
        assert torch.equal(layout.full_view(i, outs[i]), p.float())


@pytest.mark.parametrize(
    ("shapes", "dims", "world", "match"),
    [
        ([()], None, 2, "scalar"),
        ([(3, 5)], [1], 2, "does not divide"),
        ([(3,)], [1], 2, "cannot be cut along dim 1"),
        ([(3,)], None, 0, "world_size >= 1"),
        ([(3,)], [0, 0], 2, "one dim per shape"),
    ],
)
def test_bad_layouts(
    shapes: list[tuple[int, ...]], dims: list[int] | None, world: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ChunkLayout.build(shapes, world, dims)


def test_bad_tensors() -> None:
    layout = ChunkLayout.build([(4, 2)], 2)
    with pytest.raises(ValueError, match="shape"):
        layout.shard([torch.zeros(3, 2)], 0)
    with pytest.raises(ValueError, match="1-D tensor of 4 elements"):
        layout.local_views(torch.zeros(5), 0)
    with pytest.raises(ValueError, match="rank 2 is out of range"):
        layout.rows(0, 2)
    with pytest.raises(TypeError, match=r"ChunkLayout\.build: world_size must be an integer"):
        ChunkLayout.build([(4,)], 2.0)  # type: ignore[arg-type]
