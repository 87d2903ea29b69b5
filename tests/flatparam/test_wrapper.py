"""FlattenParamsWrapper against the unwrapped module: numbers, keys, errors. Single process."""

from __future__ import annotations

import copy
import io
import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from flatparam import FlatParameter, FlattenParamsWrapper


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit pattern, so equality is exact (NaN-safe, -0.0 != 0.0)."""
    return t.detach().contiguous().view(torch.uint8)


def _assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b))


def _mlp(dims: list[int], bias: bool, norm: bool, dtype: torch.dtype, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(itertools.pairwise(dims)):
        layers.append(nn.Linear(d_in, d_out, bias=bias or i == 0))
        if norm:
            layers.append(nn.LayerNorm(d_out))
        layers.append(nn.Tanh())
    return nn.Sequential(*layers).to(dtype)


class Tied(nn.Module):
    """Tied weights across modules and a second name for one Parameter on one module."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight
        self.proj.register_parameter("alias", self.proj.weight)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        h = torch.tanh(self.proj(h) + h @ self.proj.alias.t() * self.scale)
        return self.head(h)


def _wrap_all(module: nn.Module) -> FlattenParamsWrapper:
    return FlattenParamsWrapper(module, list(module.parameters()))


# --- numbers match the unwrapped module --------------------------------------------------


@given(
    dims=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    bias=st.booleans(),
    norm=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 1000),
    subset=st.integers(0, 2**16),
)
def test_forward_backward_and_state_dict_match_unwrapped(  # noqa: PLR0917
    dims: list[int], bias: bool, norm: bool, dtype: torch.dtype, seed: int, subset: int
) -> None:
    ref = _mlp(dims, bias, norm, dtype, seed)
    module = copy.deepcopy(ref)
    all_params = list(module.parameters())
    # a random non-empty subset of the parameters is flattened; the rest stay as they are
    chosen = [p for i, p in enumerate(all_params) if subset >> i & 1] or all_params[:1]
    wrapped = FlattenParamsWrapper(module, chosen)
    flat = wrapped.flat_param
    assert flat is not None
    assert flat.full_numel == sum(p.numel() for p in chosen)
    for name, _ in ref.named_parameters():
        # every original name still resolves to the same values
        _assert_bitwise(_lookup(wrapped.module, name), ref.get_parameter(name))

    x = torch.randn(3, dims[0], generator=torch.Generator().manual_seed(seed)).to(dtype)
    out, ref_out = wrapped(x), ref(x)
    _assert_bitwise(out, ref_out)
    out.square().sum().backward()
    ref_out.square().sum().backward()

    ref_params = dict(ref.named_parameters())
    chosen_names = [
        n for n, p in zip(ref_params, all_params, strict=True) if any(p is c for c in chosen)
    ]
    assert flat.grad is not None
    expected_grad = torch.cat([_grad(ref_params[n]).reshape(-1) for n in chosen_names])
    _assert_bitwise(flat.grad, expected_grad)
    for name, param in wrapped.named_parameters():  # the ones left alone keep their own grads
        if name != "flat_param":
            _assert_bitwise(_grad(param), _grad(ref_params[name.removeprefix("_fpw_module.")]))

    sd, ref_sd = wrapped.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    assert getattr(sd, "_metadata", None) == getattr(ref_sd, "_metadata", None)
    for key in ref_sd:
        _assert_bitwise(sd[key], ref_sd[key])


def _lookup(module: nn.Module, name: str) -> torch.Tensor:
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    value = getattr(module, leaf)
    assert isinstance(value, torch.Tensor)
    return value


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def test_views_alias_flat_param_and_optimizer_steps_match() -> None:
    ref = _mlp([4, 5, 3], True, True, torch.float32, 0)
    wrapped = _wrap_all(copy.deepcopy(ref))
    flat = wrapped.flat_param
    assert flat is not None
    for (start, _), (mname, module, pname) in zip(
        flat._param_offsets, flat.param_info, strict=True
    ):
        view = getattr(module, pname)
        assert not isinstance(view, nn.Parameter)
        assert view.data_ptr() == flat.data_ptr() + start * flat.element_size()
        assert mname in {"0", "1", "3", "4"}
    assert [n for n, _ in wrapped.named_parameters()] == ["flat_param"]
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for model, optim in ((wrapped, opt), (ref, ref_opt)):
            optim.zero_grad()
            model(x).sum().backward()
            optim.step()
        _assert_bitwise(wrapped(x), ref(x))


def test_shared_parameters_are_flattened_once_and_restored_to_both() -> None:
    ref = Tied()
    wrapped = _wrap_all(copy.deepcopy(ref))
    flat = wrapped.flat_param
    assert flat is not None
    # embed.weight (= head.weight), proj.weight (= proj.alias), proj.bias
    assert flat.full_numel == 20 + 16 + 4
    assert flat.metadata()[0] == ["embed.weight", "proj.weight", "proj.bias"]
    assert flat._shared_param_names == [
        ("proj.alias", "proj.weight"),
        ("head.weight", "embed.weight"),
    ]
    inner = wrapped.module
    assert inner.head.weight is inner.embed.weight
    assert inner.proj.alias is inner.proj.weight

    idx = torch.tensor([[0, 3, 4], [1, 1, 2]])
    out, ref_out = wrapped(idx), ref(idx)
    _assert_bitwise(out, ref_out)
    out.sum().backward()
    ref_out.sum().backward()
    assert flat.grad is not None
    expected = torch.cat([_grad(p).reshape(-1) for p in ref.parameters()])  # dedupes tied ones
    _assert_bitwise(flat.grad, expected)

    sd, ref_sd = wrapped.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    assert sd["head.weight"].data_ptr() == sd["embed.weight"].data_ptr() == flat.data_ptr()

    with wrapped.unflatten_params():
        assert inner.head.weight is inner.embed.weight
        assert isinstance(inner.head.weight, nn.Parameter)
        assert inner.proj.alias is inner.proj.weight
        assert list(inner.proj._parameters) == ["weight", "bias", "alias"]
    assert inner.head.weight is inner.embed.weight
    assert not isinstance(inner.head.weight, nn.Parameter)


def test_module_reachable_under_two_paths() -> None:
    shared = nn.Linear(2, 2)
    ref = nn.Sequential(shared, nn.ReLU(), shared)
    module = copy.deepcopy(ref)
    wrapped = _wrap_all(module)
    assert wrapped.flat_param is not None and wrapped.flat_param.numel() == 6
    assert list(wrapped.state_dict()) == list(ref.state_dict())
    with torch.no_grad():
        ref[0].weight.add_(1.0)
    wrapped.load_state_dict(ref.state_dict())
    x = torch.randn(3, 2)
    _assert_bitwise(wrapped(x), ref(x))
    sd = ref.state_dict()
    del sd["2.bias"]
    assert wrapped.load_state_dict(sd, strict=False).missing_keys == ["2.bias"]


def test_state_dict_round_trips_between_wrapped_and_unwrapped() -> None:
    ref = Tied()
    wrapped = _wrap_all(Tied())  # different random init
    assert not torch.equal(wrapped.module.proj.weight, ref.proj.weight)
    wrapped.load_state_dict(ref.state_dict())
    idx = torch.tensor([[0, 1, 2]])
    _assert_bitwise(wrapped(idx), ref(idx))
    # and back: the wrapper's state dict loads into a plain module
    fresh = Tied()
    with torch.no_grad():
        assert wrapped.flat_param is not None
        wrapped.flat_param.mul_(1.5)
    fresh.load_state_dict(wrapped.state_dict())
    _assert_bitwise(fresh(idx), wrapped(idx))
    # and into another wrapper
    other = _wrap_all(Tied())
    other.load_state_dict(wrapped.state_dict())
    assert other.flat_param is not None and wrapped.flat_param is not None
    _assert_bitwise(other.flat_param, wrapped.flat_param)


def test_state_dict_keep_vars_and_nested_prefix() -> None:
    ref = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)))
    parent = copy.deepcopy(ref)
    parent[1] = _wrap_all(parent[1])
    sd, ref_sd = parent.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    assert getattr(sd, "_metadata", None) == getattr(ref_sd, "_metadata", None)
    kept = parent.state_dict(keep_vars=True)
    assert kept["1.0.weight"].requires_grad and kept["1.0.weight"].grad_fn is not None
    assert not sd["1.0.weight"].requires_grad
    ref.load_state_dict(parent.state_dict())
    parent.load_state_dict(ref.state_dict())


def test_load_state_dict_reports_original_names() -> None:
    wrapped = _wrap_all(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))
    sd = wrapped.state_dict()
    del sd["1.bias"]
    sd["extra"] = torch.zeros(1)
    sd["0.extra"] = torch.zeros(1)
    result = wrapped.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["1.bias"]
    assert sorted(result.unexpected_keys) == ["0.extra", "extra"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "1.bias"'):
        wrapped.load_state_dict(sd)
    bad = wrapped.state_dict()
    bad["0.weight"] = torch.zeros(3, 3)
    with pytest.raises(
        RuntimeError,
        match=r"size mismatch for 0.weight: copying a param with shape \(3, 3\) from checkpoint, "
        r"the shape in current model is \(2, 2\)",
    ):
        wrapped.load_state_dict(bad)


def test_load_refreshes_views() -> None:
    ref = nn.Linear(3, 2)
    wrapped = _wrap_all(nn.Linear(3, 2))
    wrapped.load_state_dict(ref.state_dict())
    # the views the module holds are fresh: usable in grad mode right away
    (wrapped.module.weight * 2).sum().backward()
    assert wrapped.flat_param is not None and wrapped.flat_param.grad is not None
    _assert_bitwise(wrapped.module.weight, ref.weight.detach())


def test_sharded_flat_param_uses_the_seed_key() -> None:
    wrapped = _wrap_all(nn.Linear(3, 2))
    flat = wrapped.flat_param
    assert flat is not None
    full = flat.detach().clone()
    layout = flat.shard_for_rank(0, world_size=2)
    flat.data = full[: layout.shard_numel].clone()
    sd = wrapped.state_dict()
    assert list(sd) == ["flat_param"]
    _assert_bitwise(sd["flat_param"], full[:4])
    sd = {k: v.clone() for k, v in sd.items()}  # the saved tensor aliases the flat storage
    with torch.no_grad():
        flat.zero_()
    wrapped.load_state_dict(sd)
    _assert_bitwise(flat.detach(), full[:4])
    with pytest.raises(
        RuntimeError, match=r"cannot load \['weight', 'bias'\] into a sharded FlatParameter"
    ):
        wrapped.load_state_dict(nn.Linear(3, 2).state_dict())


def test_partial_flattening_keeps_other_parameters_and_key_order() -> None:
    ref = nn.Linear(3, 2)
    module = copy.deepcopy(ref)
    wrapped = FlattenParamsWrapper(module, [module.weight])
    assert [n for n, _ in wrapped.named_parameters()] == ["flat_param", "_fpw_module.bias"]
    assert list(wrapped.state_dict()) == ["weight", "bias"]
    with wrapped.unflatten_params():
        assert list(module._parameters) == ["weight", "bias"]
    x = torch.randn(4, 3)
    _assert_bitwise(wrapped(x), ref(x))


# --- unflatten_params --------------------------------------------------------------------


def test_unflatten_params_restores_parameters_and_keeps_changes() -> None:
    ref = _mlp([3, 4, 2], True, False, torch.float32, 3)
    wrapped = _wrap_all(copy.deepcopy(ref))
    flat = wrapped.flat_param
    assert flat is not None
    with wrapped.unflatten_params():
        assert wrapped.flat_param is None
        assert wrapped.orig_flat_param[0] is flat
        assert [n for n, _ in wrapped.module.named_parameters()] == [
            n for n, _ in ref.named_parameters()
        ]
        assert list(wrapped.state_dict()) == list(ref.state_dict())
        with wrapped.unflatten_params():  # nesting is harmless
            pass
        with torch.no_grad():
            wrapped.module[0].weight.fill_(1.0)  # in place: lands in the flat storage
        wrapped.module[2].bias = nn.Parameter(torch.full((2,), 7.0))  # replaced: copied back
    assert wrapped.flat_param is flat
    assert wrapped.orig_flat_param[0] is None
    assert torch.equal(wrapped.module[0].weight, torch.ones(4, 3))
    assert torch.equal(wrapped.module[2].bias, torch.full((2,), 7.0))
    assert [n for n, _ in wrapped.named_parameters()] == ["flat_param"]


def test_unflatten_params_restores_on_exception_and_refuses_shape_change() -> None:
    wrapped = _wrap_all(nn.Linear(2, 2))
    flat = wrapped.flat_param
    with pytest.raises(KeyError), wrapped.unflatten_params():
        raise KeyError("boom")
    assert wrapped.flat_param is flat
    replaced = r"Linear.weight was replaced by a tensor of shape \(3,\)"
    with pytest.raises(ValueError, match=replaced), wrapped.unflatten_params():
        wrapped.module.weight = nn.Parameter(torch.zeros(3))


# --- module behaviour --------------------------------------------------------------------


def test_attribute_and_index_forwarding() -> None:
    inner = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    wrapped = _wrap_all(inner)
    assert wrapped.module is inner
    assert wrapped[1] is inner[1]
    assert wrapped[0].out_features == 3
    inner.custom = "hello"  # type: ignore[assignment]
    assert wrapped.custom == "hello"
    with pytest.raises(AttributeError, match="custom2"):
        _ = wrapped.custom2


def test_to_dtype_moves_views_with_the_flat_param() -> None:
    ref = nn.Linear(3, 2).double()
    wrapped = _wrap_all(nn.Linear(3, 2))
    wrapped.double()
    flat = wrapped.flat_param
    assert flat is not None and flat.dtype == torch.float64
    assert isinstance(flat, FlatParameter)
    assert wrapped.module.weight.dtype == torch.float64
    assert wrapped.module.weight.data_ptr() == flat.data_ptr()
    wrapped.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, dtype=torch.float64)
    _assert_bitwise(wrapped(x), ref(x))


def test_to_dtype_inside_unflatten_params() -> None:
    wrapped = _wrap_all(nn.Linear(3, 2))
    flat = wrapped.flat_param
    with wrapped.unflatten_params():
        wrapped.double()
        assert wrapped.module.weight.dtype == torch.float64
        with torch.no_grad():
            wrapped.module.weight.fill_(0.25)
    assert wrapped.flat_param is flat
    assert flat is not None and flat.dtype == torch.float64
    assert torch.equal(wrapped.module.weight, torch.full((2, 3), 0.25, dtype=torch.float64))


class WithExtraState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(2))
        self.register_buffer("buf", torch.zeros(1))
        self.b = nn.Parameter(torch.ones(3))
        self.child = nn.Linear(1, 1)

    def get_extra_state(self) -> dict[str, int]:
        return {"step": 7}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.loaded = state


def test_state_dict_order_with_buffers_and_extra_state() -> None:
    ref = WithExtraState()
    module = WithExtraState()
    wrapped = FlattenParamsWrapper(module, [module.b, module.child.weight])
    expected = ["a", "b", "buf", "_extra_state", "child.weight", "child.bias"]
    assert list(ref.state_dict()) == expected
    assert list(wrapped.state_dict()) == expected
    wrapped.load_state_dict(ref.state_dict())
    assert module.loaded == {"step": 7}


def test_deepcopy_and_save_load() -> None:
    wrapped = _wrap_all(Tied())
    x = torch.tensor([[1, 2]])
    buf = io.BytesIO()
    torch.save(wrapped, buf)
    buf.seek(0)
    for other in (copy.deepcopy(wrapped), torch.load(buf, weights_only=False)):
        assert isinstance(other, FlattenParamsWrapper)
        flat = other.flat_param
        assert isinstance(flat, FlatParameter)
        assert flat.param_info[0].module is other.module.embed
        assert other.module.embed.weight.data_ptr() == flat.data_ptr()
        assert other.module.head.weight is other.module.embed.weight
        _assert_bitwise(other(x), wrapped(x))


def test_empty_param_list() -> None:
    ref = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    wrapped = FlattenParamsWrapper(copy.deepcopy(ref), [])
    assert wrapped.flat_param is None
    assert wrapped.no_params
    assert [n for n, _ in wrapped.named_parameters()] == [
        f"_fpw_module.{n}" for n, _ in ref.named_parameters()
    ]
    assert list(wrapped.state_dict()) == list(ref.state_dict())
    wrapped.load_state_dict(ref.state_dict())
    with wrapped.unflatten_params():
        pass
    x = torch.randn(3, 2)
    _assert_bitwise(wrapped(x), ref(x))


def test_module_without_parameters() -> None:
    wrapped = _wrap_all(nn.ReLU())
    assert wrapped.flat_param is None
    assert wrapped.state_dict() == {}


def test_non_contiguous_parameter_in_module() -> None:
    ref = nn.Linear(4, 3)
    ref.weight = nn.Parameter(torch.randn(4, 3).t())  # non-contiguous (3, 4)
    assert not ref.weight.is_contiguous()
    wrapped = _wrap_all(copy.deepcopy(ref))
    x = torch.randn(2, 4)
    torch.testing.assert_close(
        wrapped(x), ref(x), rtol=0, atol=1e-6
    )  # layout may change the kernel
    _assert_bitwise(wrapped.module.weight, ref.weight)
    assert list(wrapped.state_dict()) == ["weight", "bias"]


def test_meta_device_module() -> None:
    with torch.device("meta"):
        module = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))
    wrapped = _wrap_all(module)
    flat = wrapped.flat_param
    assert flat is not None and flat.is_meta
    assert flat.metadata()[0] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert flat.full_numel == 1000 * 1000 + 1000 + 10 * 1000 + 10
    assert wrapped(torch.empty(2, 1000, device="meta")).shape == (2, 10)
    sd = wrapped.state_dict()
    assert all(t.is_meta for t in sd.values())
    # assign=True materialises it from a real state dict
    real = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))
    wrapped.load_state_dict(real.state_dict(), assign=True)
    flat = wrapped.flat_param
    assert isinstance(flat, FlatParameter) and not flat.is_meta
    assert flat.metadata()[0] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    x = torch.randn(2, 1000)
    _assert_bitwise(wrapped(x), real(x))


# --- errors ------------------------------------------------------------------------------


def test_mixed_dtypes_refused_naming_parameters() -> None:
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(
        ValueError,
        match=r"FlattenParamsWrapper needs every parameter to have the same dtype "
        r"\(a FlatParameter is one tensor\), got torch.float32: 0.weight, 0.bias; "
        r"torch.float64: 1.weight, 1.bias; "
        r"cast them to one dtype first",
    ):
        FlattenParamsWrapper(module, list(module.parameters()))
    # leaving the odd ones out works
    wrapped = FlattenParamsWrapper(module, list(module[0].parameters()))
    assert wrapped.flat_param is not None and wrapped.flat_param.dtype == torch.float32


def test_mixed_requires_grad_refused_naming_parameters() -> None:
    module = nn.Linear(2, 2)
    module.bias.requires_grad_(False)
    with pytest.raises(
        ValueError, match=r"same requires_grad .*, got True: weight; False: bias; set one"
    ):
        FlattenParamsWrapper(module, list(module.parameters()))


def test_bad_param_list_items() -> None:
    module = nn.Linear(2, 2)
    with pytest.raises(
        ValueError,
        match=r"1 parameter\(s\) in param_list are not parameters of the wrapped module "
        r"\(shape \(5,\)\)",
    ):
        FlattenParamsWrapper(module, [module.weight, nn.Parameter(torch.zeros(5))])
    with pytest.raises(TypeError, match=r"must hold nn.Parameters, got \[\(0, 'Tensor'\)\]"):
        FlattenParamsWrapper(module, [torch.zeros(2)])  # type: ignore[list-item]


def test_duplicates_in_param_list_are_harmless() -> None:
    module = nn.Linear(2, 2)
    wrapped = FlattenParamsWrapper(module, [module.weight, module.weight, module.bias])
    assert wrapped.flat_param is not None and wrapped.flat_param.numel() == 6
