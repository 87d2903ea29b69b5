"""FlatParameter on its own: layout, views, shard metadata, errors. Single process."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from flatparam import FlatParameter, ShardLayout, ShardMetadata


def _params(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def test_layout_and_metadata() -> None:
    params = _params((2, 3), (4,), ())
    flat = FlatParameter(params, requires_grad=True)
    assert isinstance(flat, nn.Parameter)
    assert flat.requires_grad
    assert flat.shape == (11,)
    assert flat.full_numel == 11
    assert torch.equal(flat.detach(), torch.cat([p.detach().reshape(-1) for p in params]))
    assert flat._param_numels == [6, 4, 1]
    assert flat._param_shapes == [torch.Size([2, 3]), torch.Size([4]), torch.Size([])]
    assert flat._param_offsets == [(0, 5), (6, 9), (10, 10)]  # inclusive ends, as in the seed
    assert flat.num_padded == 0
    assert flat.metadata() == ([], flat._param_shapes, [6, 4, 1])  # names come from a wrapper
    assert flat.shard_metadata() == ShardMetadata(
        [],
        [torch.Size([2, 3]), torch.Size([4]), torch.Size([])],
        [6, 4, 1],
        [(0, 5), (0, 3), (0, 0)],
    )
    assert not flat._is_sharded


def test_flat_is_a_copy_not_an_alias_of_the_inputs() -> None:
    params = _params((3,))
    flat = FlatParameter(params, requires_grad=False)
    assert not flat.requires_grad
    with torch.no_grad():
        flat.zero_()
    assert params[0].abs().sum() > 0


def test_views_alias_the_flat_storage() -> None:
    params = _params((2, 3), (4,), (1, 1))
    flat = FlatParameter(params)
    views = list(flat.get_param_views())
    for view, param, (start, _) in zip(views, params, flat._param_offsets, strict=True):
        assert view.shape == param.shape
        assert torch.equal(view, param)
        assert view.data_ptr() == flat.data_ptr() + start * flat.element_size()
    with torch.no_grad():
        views[1][2] = 42.0
    assert flat[6 + 2].item() == 42.0
    with torch.no_grad():
        flat[0] = -1.0
        assert views[0][0, 0].item() == -1.0


def test_stale_split_views_are_refused_in_grad_mode() -> None:
    # The views come from one split (see [Note: flat parameter views]): after an
    # in-place change of the flat tensor, autograd refuses the old views and fresh
    # ones must be taken, which is what the wrapper does before every forward.
    flat = FlatParameter(_params((2,), (3,)))
    views = list(flat.get_param_views())
    with torch.no_grad():
        flat.add_(1.0)  # an optimizer step
    with pytest.raises(RuntimeError, match="modified inplace"):
        views[0] * 2
    fresh = list(flat.get_param_views())
    (fresh[0] * 2).sum().backward()
    assert flat.grad is not None


def test_views_of_external_data_alias_it() -> None:
    flat = FlatParameter(_params((2, 2), (3,)))
    other = torch.arange(7.0, dtype=torch.float64)
    views = list(flat.get_param_views(other))
    assert [v.dtype for v in views] == [torch.float64, torch.float64]
    assert views[1].data_ptr() == other.data_ptr() + 4 * other.element_size()
    assert torch.equal(views[0], torch.tensor([[0.0, 1.0], [2.0, 3.0]], dtype=torch.float64))


def test_gradients_of_views_land_in_flat_grad() -> None:
    flat = FlatParameter(_params((2, 2), (3,)))
    w, b = flat.get_param_views()
    (w.sum() * 2 + (b * torch.tensor([1.0, 2.0, 3.0])).sum()).backward()
    assert flat.grad is not None
    assert torch.equal(flat.grad, torch.tensor([2.0, 2.0, 2.0, 2.0, 1.0, 2.0, 3.0]))


def test_non_contiguous_parameters() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    transposed = nn.Parameter(base.t())  # strides (1, 4)
    strided = nn.Parameter(torch.arange(10.0)[::2])  # stride 2
    assert not transposed.is_contiguous() and not strided.is_contiguous()
    flat = FlatParameter([transposed, strided])
    views = list(flat.get_param_views())
    assert torch.equal(views[0], transposed)
    assert torch.equal(views[1], strided)
    assert torch.equal(flat.detach()[:12], base.t().reshape(-1))


def test_zero_numel_and_scalar_parameters() -> None:
    params = [nn.Parameter(torch.empty(0, 3)), nn.Parameter(torch.tensor(5.0))]
    flat = FlatParameter(params)
    assert flat.numel() == 1
    assert flat._param_offsets == [(0, -1), (0, 0)]
    views = list(flat.get_param_views())
    assert views[0].shape == (0, 3) and views[1].shape == ()
    assert views[1].item() == 5.0


def test_meta_device_gives_metadata_without_storage() -> None:
    with torch.device("meta"):
        params = [nn.Parameter(torch.empty(1000, 1000)), nn.Parameter(torch.empty(7))]
    flat = FlatParameter(params)
    assert flat.is_meta
    assert flat.full_numel == 1_000_007
    assert [v.shape for v in flat.get_param_views()] == [(1000, 1000), (7,)]
    assert all(v.is_meta for v in flat.get_param_views())


def test_deepcopy_and_pickle_keep_type_and_metadata() -> None:
    flat = FlatParameter(_params((2, 2), (3,)))
    flat.shard_by_offsets(4, 7, 1)
    for copied in (copy.deepcopy(flat), _pickled(flat)):
        assert type(copied) is FlatParameter
        assert copied.data_ptr() != flat.data_ptr()
        assert torch.equal(copied, flat)
        assert copied._param_shapes == flat._param_shapes
        assert copied.shard_metadata() == flat.shard_metadata()
        assert copied.num_padded == 1


def _pickled(flat: FlatParameter) -> FlatParameter:
    buf = io.BytesIO()
    torch.save(flat, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded, FlatParameter)
    return loaded


# --- seed shard metadata ---------------------------------------------------------------


def test_shard_by_offsets_like_the_seed() -> None:
    flat = FlatParameter(_params((2, 3), (4,), (3,)))  # offsets (0,5) (6,9) (10,12)
    flat.shard_by_offsets(4, 10, 0)
    assert flat._is_sharded
    assert flat._param_indice_in_shard == (0, 2)
    meta = flat.shard_metadata()
    assert meta.param_numels == [6, 4, 3]
    assert meta.param_offsets == [(4, 5), (0, 3), (0, 0)]  # inclusive, inside each parameter
    flat.shard_by_offsets(7, 8, 0)
    assert flat.shard_metadata().param_offsets == [(1, 2)]
    assert flat._param_indice_in_shard == (1, 1)


def test_shard_by_offsets_all_padding() -> None:
    flat = FlatParameter(_params((3,)))
    flat.shard_by_offsets(4, 5, 2)  # chunk of a padded flat tensor of 6, all padding
    assert flat.shard_metadata() == ShardMetadata([], [], [], [])
    assert flat.num_padded == 2
    assert flat._param_indice_in_shard == (0, -1)


def test_shard_by_offsets_errors() -> None:
    flat = FlatParameter(_params((4,)))
    with pytest.raises(ValueError, match=r"invalid offset pair \(3, 2\)"):
        flat.shard_by_offsets(3, 2, 0)
    with pytest.raises(ValueError, match=r"invalid offset pair \(-1, 2\)"):
        flat.shard_by_offsets(-1, 2, 0)
    with pytest.raises(ValueError, match=r"padding \(3\) is larger than the shard size \(2 = "):
        flat.shard_by_offsets(0, 1, 3)
    with pytest.raises(ValueError, match=r"runs 2 elements past full_numel 4, but num_padded is 1"):
        flat.shard_by_offsets(2, 5, 1)


@given(
    numels=st.lists(st.integers(0, 30), min_size=1, max_size=6),
    world_size=st.integers(1, 8),
    align=st.sampled_from([1, 2, 4, 8]),
)
def test_apply_shard_layout_matches_pieces_and_seed_offsets(
    numels: list[int], world_size: int, align: int
) -> None:
    flat = FlatParameter([torch.zeros(n) for n in numels], requires_grad=False)
    layout = flat.layout_for(world_size, align)
    assert layout == ShardLayout.build(numels, world_size, align)
    for rank in range(world_size):
        flat.apply_shard_layout(layout, rank)
        meta = flat.shard_metadata()
        pieces = layout.pieces(rank)
        assert meta.param_numels == [numels[p.param_index] for p in pieces]
        assert meta.param_offsets == [(p.param_start, p.param_end - 1) for p in pieces]
        assert flat.num_padded == layout.num_padded(rank)
        assert (flat.shard_layout, flat.shard_rank) == (layout, rank)
        if layout.shard_numel:
            start, end = layout.bounds(rank)
            seed_style = FlatParameter([torch.zeros(n) for n in numels], requires_grad=False)
            seed_style.shard_by_offsets(start, end - 1, layout.num_padded(rank))
            assert seed_style.shard_metadata() == meta
            assert seed_style._param_indice_in_shard == flat._param_indice_in_shard


def test_shard_for_rank_and_layout_mismatch() -> None:
    flat = FlatParameter(_params((5,), (3,)))
    layout = flat.shard_for_rank(1, world_size=2, align_numel=4)
    assert layout.shard_numel == 4
    assert flat.shard_metadata().param_offsets == [(4, 4), (0, 2)]
    with pytest.raises(
        ValueError, match=r"built for numels \(8,\) but this FlatParameter holds \(5, 3\)"
    ):
        flat.apply_shard_layout(ShardLayout.build([8], 2), 0)
    with pytest.raises(ValueError, match=r"rank 2 is out of range for world_size 2"):
        flat.apply_shard_layout(layout, 2)


# --- errors ----------------------------------------------------------------------------


def test_construction_errors() -> None:
    with pytest.raises(ValueError, match=r"non-empty list or tuple of parameters, got \[\]"):
        FlatParameter([])
    with pytest.raises(ValueError, match=r"non-empty list or tuple"):
        FlatParameter(iter(_params((2,))))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Parameters or Tensors, got \[\(1, 'int'\)\]"):
        FlatParameter([nn.Parameter(torch.zeros(1)), 3])  # type: ignore[list-item]
    inner = FlatParameter(_params((2,)))
    with pytest.raises(ValueError, match=r"Nesting FlatParameter is not supported: params\[1\]"):
        FlatParameter([nn.Parameter(torch.zeros(2)), inner])


def test_mixed_dtypes_are_refused_with_names() -> None:
    params = [*_params((2,), (3,)), *_params((4,), dtype=torch.float64)]
    msg = (
        r"same dtype \(a FlatParameter is one tensor\), got torch.float32: params\[0\] "
        r"\(shape \(2,\)\), params\[1\] \(shape \(3,\)\); "
        r"torch.float64: params\[2\] \(shape \(4,\)\); "
        r"cast them to one dtype"
    )
    with pytest.raises(ValueError, match=msg):
        FlatParameter(params)


def test_mixed_requires_grad_and_devices_are_refused() -> None:
    frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
    with pytest.raises(
        ValueError, match=r"same requires_grad .* True: params\[0\] .*; False: params\[1\]"
    ):
        FlatParameter([nn.Parameter(torch.zeros(3)), frozen])
    with pytest.raises(ValueError, match=r"same device .* cpu: params\[0\] .*; meta: params\[1\]"):
        FlatParameter([nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, device="meta"))])


def test_get_param_views_errors() -> None:
    flat = FlatParameter(_params((2,), (3,)))
    with pytest.raises(
        ValueError, match=r"external_data has shape \(4,\) but the views need a 1-D"
    ):
        flat.get_param_views(torch.zeros(4))
    with pytest.raises(ValueError, match=r"external_data has shape \(5, 1\)"):
        flat.get_param_views(torch.zeros(5, 1))
    flat.data = flat.data[:3].clone()  # what a sharding runtime does
    with pytest.raises(
        ValueError, match=r"this FlatParameter has shape \(3,\) .* pass the gathered"
    ):
        flat.get_param_views()
    assert len(list(flat.get_param_views(torch.zeros(5)))) == 2
    with pytest.raises(RuntimeError, match=r"`_param_infos` has not been set"):
        _ = flat._num_unflattened_params
