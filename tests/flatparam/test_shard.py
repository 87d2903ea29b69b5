"""ShardLayout and the flat-tensor helpers: pure, single process."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flatparam import (
    ShardLayout,
    ShardPiece,
    align_numel_for,
    pad_flat,
    shard_flat,
    unpad_flat,
    unshard_flat,
)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.uint8]

numels_st = st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=8)
world_st = st.integers(min_value=1, max_value=8)
align_st = st.sampled_from([1, 2, 3, 4, 8, 16])


def _random_flat(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


# --- worked examples -------------------------------------------------------------------


def test_layout_example_with_padding_on_last_rank() -> None:
    # params of 3, 4, 3 elements over 4 ranks: chunks of 3, 2 padding at the end
    layout = ShardLayout.build([3, 4, 3], world_size=4)
    assert layout.full_numel == 10
    assert layout.shard_numel == 3
    assert layout.padded_numel == 12
    assert [layout.bounds(r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert [layout.num_padded(r) for r in range(4)] == [0, 0, 0, 2]
    assert layout.pieces(0) == (ShardPiece(0, 0, 3, 0),)
    assert layout.pieces(1) == (ShardPiece(1, 0, 3, 0),)
    assert layout.pieces(2) == (ShardPiece(1, 3, 4, 0), ShardPiece(2, 0, 2, 1))
    assert layout.pieces(3) == (ShardPiece(2, 2, 3, 0),)
    assert list(layout.ranks_of(1)) == [1, 2]


def test_layout_alignment_rounds_chunk_up() -> None:
    layout = ShardLayout.build([5], world_size=2, align_numel=4)
    assert layout.shard_numel == 4  # ceil(5 / 2) = 3, rounded up to 4
    assert [layout.num_padded(r) for r in range(2)] == [0, 3]


def test_rank_with_padding_only() -> None:
    layout = ShardLayout.build([2], world_size=4, align_numel=2)
    assert layout.shard_numel == 2
    assert layout.pieces(1) == ()
    assert layout.num_padded(1) == 2
    assert layout.data_numel(1) == 0
    chunk = shard_flat(torch.tensor([1.0, 2.0]), layout, 3)
    assert torch.equal(chunk, torch.zeros(2))


def test_empty_layout() -> None:
    layout = ShardLayout.build([], world_size=3)
    assert (layout.full_numel, layout.shard_numel, layout.padded_numel) == (0, 0, 0)
    assert layout.bounds(2) == (0, 0)
    assert layout.pieces(0) == ()
    flat = torch.empty(0)
    assert shard_flat(flat, layout, 1).numel() == 0
    assert unshard_flat([shard_flat(flat, layout, r) for r in range(3)], layout).numel() == 0


def test_zero_numel_parameters_have_no_pieces() -> None:
    layout = ShardLayout.build([0, 3, 0, 1], world_size=2)
    indices = [p.param_index for r in range(2) for p in layout.pieces(r)]
    assert indices == [1, 1, 3]  # shard_numel 2: rank 0 has 1[0:2], rank 1 has 1[2:3] and 3
    assert list(layout.ranks_of(0)) == []
    assert layout.param_bounds(2) == (3, 3)


def test_align_numel_for() -> None:
    assert align_numel_for(torch.float32, 16) == 4
    assert align_numel_for(torch.bfloat16, 16) == 8
    assert align_numel_for(torch.float64, 16) == 2
    assert align_numel_for(torch.float64, 4) == 1
    assert align_numel_for(torch.uint8, 16) == 16
    assert align_numel_for(torch.float32, 6) == 3  # 3 * 4 bytes = 12, a multiple of 6
    assert align_numel_for(torch.float32, 1) == 1


def test_layout_is_hashable_and_equal_by_value() -> None:
    a = ShardLayout.build([1, 2], 2, 2)
    b = ShardLayout((1, 2), 2, 2)
    assert a == b
    assert hash(a) == hash(b)


def test_chunks_start_aligned_in_bytes() -> None:
    for dtype in (torch.float32, torch.float16, torch.float64):
        layout = ShardLayout.build([7, 5], world_size=3, align_numel=align_numel_for(dtype, 16))
        padded = pad_flat(torch.zeros(12, dtype=dtype), layout)
        for r in range(3):
            start, _ = layout.bounds(r)
            assert (start * dtype.itemsize) % 16 == 0
            assert padded[start:].data_ptr() - padded.data_ptr() == start * dtype.itemsize


def test_shard_flat_is_differentiable_and_new() -> None:
    flat = torch.arange(5.0, requires_grad=True)
    layout = ShardLayout.build([5], world_size=2)
    chunk = shard_flat(flat, layout, 1)
    assert chunk.data_ptr() != flat.data_ptr()
    chunk.sum().backward()
    assert flat.grad is not None
    assert torch.equal(flat.grad, torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0]))


def test_meta_tensors_shard() -> None:
    layout = ShardLayout.build([3, 3], world_size=4)
    flat = torch.empty(6, device="meta")
    chunk = shard_flat(flat, layout, 3)
    assert chunk.device.type == "meta"
    assert chunk.shape == (layout.shard_numel,)
    assert pad_flat(flat, layout).shape == (layout.padded_numel,)


# --- error paths -----------------------------------------------------------------------


def test_layout_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"world_size >= 1, got 0"):
        ShardLayout.build([1], 0)
    with pytest.raises(ValueError, match=r"align_numel >= 1, got 0"):
        ShardLayout.build([1], 2, 0)
    with pytest.raises(ValueError, match=r"non-negative integer numels, got \[\(1, -2\)\]"):
        ShardLayout.build([1, -2], 2)
    with pytest.raises(TypeError, match=r"numels must be a tuple of ints, got list"):
        ShardLayout([1, 2], 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"world_size >= 1, got True"):
        ShardLayout((1,), True)


def test_layout_rejects_bad_rank() -> None:
    layout = ShardLayout.build([4], 2)
    for method in (layout.bounds, layout.pieces, layout.num_padded):
        with pytest.raises(ValueError, match=r"rank 2 is out of range for world_size 2"):
            method(2)
        with pytest.raises(ValueError, match=r"rank -1 is out of range"):
            method(-1)
    with pytest.raises(IndexError, match=r"param_index 1 is out of range for a layout of 1"):
        layout.param_bounds(1)


def test_align_numel_for_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"align_bytes must be a positive int, got 0"):
        align_numel_for(torch.float32, 0)
    with pytest.raises(TypeError, match=r"needs a torch.dtype, got str"):
        align_numel_for("float32", 16)  # type: ignore[arg-type]


def test_tensor_helpers_reject_wrong_sizes() -> None:
    layout = ShardLayout.build([3, 2], 2)
    with pytest.raises(ValueError, match=r"full_numel = 5 elements for this layout, got 4"):
        shard_flat(torch.zeros(4), layout, 0)
    with pytest.raises(ValueError, match=r"needs a 1-D tensor, got shape \(5, 1\)"):
        pad_flat(torch.zeros(5, 1), layout)
    with pytest.raises(ValueError, match=r"padded_numel = 6 elements for this layout, got 5"):
        unpad_flat(torch.zeros(5), layout)
    with pytest.raises(ValueError, match=r"one chunk per rank \(2\), got 1"):
        unshard_flat([torch.zeros(3)], layout)
    with pytest.raises(ValueError, match=r"chunk 1 has shape \(2,\), expected \(3,\)"):
        unshard_flat([torch.zeros(3), torch.zeros(2)], layout)


# --- properties ------------------------------------------------------------------------


@given(numels=numels_st, world_size=world_st, align=align_st)
def test_layout_invariants(numels: list[int], world_size: int, align: int) -> None:
    layout = ShardLayout.build(numels, world_size, align)
    full = sum(numels)
    assert layout.full_numel == full
    assert layout.shard_numel % align == 0
    assert layout.padded_numel == layout.shard_numel * world_size >= full
    # the chunk is as small as the constraints allow
    assert layout.shard_numel - align < -(-full // world_size) or layout.shard_numel == 0
    # chunks tile the padded flat tensor
    bounds = [layout.bounds(r) for r in range(world_size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == layout.padded_numel
    assert all(b[1] == nb[0] for b, nb in itertools.pairwise(bounds))
    assert sum(layout.data_numel(r) for r in range(world_size)) == full
    assert sum(layout.num_padded(r) for r in range(world_size)) == layout.padded_numel - full


@given(numels=numels_st, world_size=world_st, align=align_st)
def test_pieces_cover_every_element_exactly_once(
    numels: list[int], world_size: int, align: int
) -> None:
    layout = ShardLayout.build(numels, world_size, align)
    seen: list[list[int]] = [[0] * n for n in numels]
    for r in range(world_size):
        pieces = layout.pieces(r)
        start, _ = layout.bounds(r)
        cursor = 0
        for piece in pieces:
            assert piece.numel > 0
            assert piece.shard_offset == cursor  # contiguous inside the chunk
            cursor += piece.numel
            p_start, _ = layout.param_bounds(piece.param_index)
            # the piece's position in the flat tensor agrees with its position in the chunk
            assert p_start + piece.param_start == start + piece.shard_offset
            assert r in layout.ranks_of(piece.param_index)
            for e in range(piece.param_start, piece.param_end):
                seen[piece.param_index][e] += 1
        assert cursor == layout.data_numel(r)
        assert [p.param_index for p in pieces] == sorted({p.param_index for p in pieces})
    assert all(count == 1 for counts in seen for count in counts)


@given(
    numels=numels_st,
    world_size=world_st,
    align=align_st,
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_shard_unshard_round_trip_is_bitwise(
    numels: list[int], world_size: int, align: int, dtype: torch.dtype, seed: int
) -> None:
    layout = ShardLayout.build(numels, world_size, align)
    flat = _random_flat(layout.full_numel, dtype, seed)
    chunks = [shard_flat(flat, layout, r) for r in range(world_size)]
    for r, chunk in enumerate(chunks):
        assert chunk.dtype == dtype
        assert chunk.numel() == layout.shard_numel
        # padding is zeros at the end of the chunk
        pad = layout.num_padded(r)
        assert torch.equal(chunk[layout.shard_numel - pad :], torch.zeros(pad, dtype=dtype))
        # each piece holds exactly the parameter's slice
        for piece in layout.pieces(r):
            p_start, _ = layout.param_bounds(piece.param_index)
            param = flat[p_start : p_start + numels[piece.param_index]]
            got = chunk[piece.shard_offset : piece.shard_offset + piece.numel]
            assert torch.equal(got, param[piece.param_start : piece.param_end])
    rebuilt = unshard_flat(chunks, layout)
    assert torch.equal(rebuilt.view(torch.uint8), flat.view(torch.uint8))
    padded = torch.cat(chunks)
    assert torch.equal(padded, pad_flat(flat, layout))
    unpadded = unpad_flat(padded, layout)
    assert unpadded.data_ptr() == padded.data_ptr()  # a view, not a copy
    assert torch.equal(unpadded.view(torch.uint8), flat.view(torch.uint8))
