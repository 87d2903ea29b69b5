"""All-gather extensions ([Note: all-gather extensions]) against torch's ``fully_shard``.

torch's ``test_fully_shard_extensions.py`` scenarios that run on CPU, rewritten
for our harness, each trained with torch's ``fully_shard`` and with ours on the
same model and data: losses, every full gradient and every full parameter after
each of three steps, bit for bit.

- ``TwoTensor`` weights whose class gets ``fsdp_pre_all_gather`` (the old
  one-argument and the five-argument signature) and ``fsdp_post_all_gather``:
  two all-gather inputs per parameter, ``out=`` reuse on every later gather
  (the post method asserts the outputs are the same storage), resharded after
  forward or not; also built on the meta device with bf16 parameters.
- Methods set on each sharded parameter's local tensor after ``to_empty``
  (no subclass method at ``fully_shard`` time), gathering bf16.
- A subclass that pads its own unevenly sharded chunk (``outer_size``).
- HSDP: the methods receive the 1-D shard mesh.
- A weight that gathers int8 data and a float32 scale (several inputs of their
  own dtypes, so the gather moves bytes): every all-gather's bytes are counted
  and equal torch's, one byte per element of the weight.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from tests.fully_shard._common import compare
from tests.ranks import run_ranks

STEPS = 3


class MLP(nn.Module):
    """torch's test MLP: in_proj, relu, out_proj."""

    def __init__(self, dim: int, bias: bool = True, mult: int = 4) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim * mult, bias=bias)
        self.out_proj = nn.Linear(dim * mult, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


# --- TwoTensor with the extension on its class (torch's test's methods, our words) ---------


def _two_pre_v1(self: Any, mesh: Any) -> tuple[tuple[Tensor, ...], Any]:
    return (self.a, self.b), None


def _two_pre_v2(  # noqa: PLR0917 (torch calls it positionally)
    self: Any, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
) -> tuple[tuple[Tensor, ...], Any]:
    return (self.a, self.b), None


def _two_post(
    self: Any,
    outputs: tuple[Tensor, ...],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: Any = None,
) -> Any:
    from torch.testing._internal.two_tensor import TwoTensor

    assert metadata is None
    a, b = outputs
    if out is not None:
        assert isinstance(out, TwoTensor)
        if a.dtype == param_dtype:  # no cast: the outputs are the unsharded tensors' storage
            assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
            assert b.untyped_storage().data_ptr() == out.b.untyped_storage().data_ptr()
        else:
            out.a.copy_(a)
            out.b.copy_(b)
        return None
    return TwoTensor(a, b).to(param_dtype), (a, b)


def _two_tensor_mlps(pre_version: int) -> nn.Module:
    from torch.testing._internal.two_tensor import TwoTensor

    TwoTensor.fsdp_pre_all_gather = _two_pre_v1 if pre_version == 1 else _two_pre_v2  # type: ignore[attr-defined]
    TwoTensor.fsdp_post_all_gather = _two_post  # type: ignore[attr-defined]
    return _plain_two_tensor_mlps()


def _plain_two_tensor_mlps() -> nn.Module:
    from torch.testing._internal.two_tensor import TwoTensor

    model = nn.Sequential(*[MLP(8, bias=False) for _ in range(3)])
    for mlp in model:
        for lin in (mlp.in_proj, mlp.out_proj):
            lin.weight = nn.Parameter(TwoTensor(lin.weight, lin.weight.clone()))
    return model


# --- a subclass that pads its own chunk (torch's BFloat16AllGatherTensor, reduced) ---------


class Bf16Gathered(torch.Tensor):
    """A float32 tensor that gathers as bf16, padding an uneven chunk itself."""

    _data: Tensor

    @staticmethod
    def __new__(cls, data: Tensor) -> Bf16Gathered:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype,
            device=data.device,
        )  # fmt: skip

    def __init__(self, data: Tensor) -> None:
        self._data = data

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[Tensor, ...], Any]:
        rows = math.ceil(outer_size[0] / mesh.size())
        padded = torch.zeros((rows, *outer_size[1:]), dtype=torch.bfloat16, device=self.device)
        padded[: self._data.size(0)].copy_(self._data)
        return (padded,), None

    @torch.no_grad()
    def fsdp_post_all_gather(
        self,
        outputs: tuple[Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Any = None,
    ) -> Any:
        (t,) = outputs
        assert t.dtype == torch.bfloat16
        if out is not None:
            with _unsafe_preserve_version_counter(out):
                out.copy_(t)
            return None
        up = t.to(param_dtype)
        return up, (t, up)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(
            *pytree.tree_map_only(cls, lambda x: x._data, args),
            **pytree.tree_map_only(cls, lambda x: x._data, kwargs or {}),
        )
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: Any, meta: Any, outer_size: Any, outer_stride: Any) -> Tensor:
        return inner["_data"]  # type: ignore[no-any-return]


# --- a weight that gathers int8 data and a float32 scale ------------------------------------


class Int8Gathered(Bf16Gathered):
    """Gathers each rank's chunk as int8 plus that chunk's float32 scale: two inputs of two
    dtypes (one byte per weight element on the wire), dequantized after the gather."""

    calls: ClassVar[list[str]] = []  # what the methods saw, in this rank

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[Tensor, ...], Any]:
        scale = (self._data.abs().amax() / 127).clamp(min=1e-8).reshape(1)
        q = torch.round(self._data / scale).clamp(-127, 127).to(torch.int8)
        rows = self._data.size(0)
        Int8Gathered.calls.append(f"pre:{mesh.ndim}:{mesh.size()}")
        return (q, scale.expand(rows).contiguous()), rows

    @torch.no_grad()
    def fsdp_post_all_gather(
        self,
        outputs: tuple[Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Any = None,
    ) -> Any:
        q, scales = outputs
        rows = metadata
        w = q.to(torch.float32) * scales.view(-1, 1)
        assert q.shape[0] == scales.shape[0] and q.shape[0] % rows == 0
        if out is not None:
            Int8Gathered.calls.append("post:out")
            with _unsafe_preserve_version_counter(out):
                out.copy_(w.to(param_dtype))
            return None
        Int8Gathered.calls.append("post:new")
        w = w.to(param_dtype)
        return w, (w,)


def _subclass_mlp(cls: type, dim: int, mult: int, bias: bool = True) -> nn.Module:
    model = MLP(dim, bias=bias, mult=mult)
    for lin in (model.in_proj, model.out_proj):
        lin.weight = nn.Parameter(cls(lin.weight.detach().clone()))
    return model


# --- training, both implementations -----------------------------------------------------


def _api(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed.fsdp as api
    else:
        import fsdp as api  # type: ignore[no-redef]
    return api


def _plain(t: Any) -> Tensor:
    """A full value as a plain tensor (a TwoTensor's two halves side by side).

    A sharded TwoTensor is gathered half by half, as plain DTensors: torch 2.13's
    functional collectives on gloo corrupt the heap now and then when their input is
    a tensor subclass (``DTensor.full_tensor`` of a DTensor over a TwoTensor crashed a
    rank in CI; torch alone, without our package, crashes the same way in a loop).
    """
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.two_tensor import TwoTensor

    if isinstance(t, DTensor) and isinstance(t.to_local(), TwoTensor):
        local, spec = t.to_local(), (t.device_mesh, t.placements)
        halves = [
            DTensor.from_local(h.detach(), *spec, shape=t.shape, stride=t.stride()).full_tensor()
            for h in (local.a, local.b)
        ]
        return torch.cat([h.reshape(-1) for h in halves]).clone()
    t = t.full_tensor() if isinstance(t, DTensor) else t
    if isinstance(t, TwoTensor):
        return torch.cat([t.a.detach().reshape(-1), t.b.detach().reshape(-1)]).clone()
    if isinstance(t, Bf16Gathered):
        return t._data.detach().clone()
    return t.detach().clone()


def _train(
    model: nn.Module,
    dim: int,
    opt_kwargs: dict[str, Any],
    steps: int = STEPS,
    accumulate: int = 1,
) -> dict[str, list[Any]]:
    """Losses, full gradients and full parameters of each step (``accumulate``
    micro-batches per step, all but the last without gradient sync)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **opt_kwargs)
    g = torch.Generator().manual_seed(42 + dist.get_rank())
    record: dict[str, list[Any]] = {"loss": [], "grads": [], "params": []}
    for step in range(steps):
        for micro in range(accumulate):
            if accumulate > 1:
                model.set_requires_gradient_sync(micro == accumulate - 1)  # type: ignore[operator]
            loss = model(torch.randn(2, dim, generator=g)).sum()
            loss.backward()
            record["loss"].append(loss.item())
        record["grads"].append(
            {n: _plain(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        )
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        record["params"].append({n: _plain(p) for n, p in model.named_parameters()})
    return record


def _shard_all(api: Any, model: nn.Module, **kwargs: Any) -> None:
    for mlp in model:  # type: ignore[attr-defined]
        api.fully_shard(mlp, **kwargs)
    api.fully_shard(model, **kwargs)


def _init_after_to_empty(model: nn.Module) -> None:
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    for p in model.parameters():
        nn.init.trunc_normal_(p)


def _two_tensor_case(
    impl: str,
    *,
    pre_version: int,
    reshard: bool,
    meta: bool,
    offload: bool = False,
    accumulate: int = 1,
) -> dict[str, list[Any]]:
    api = _api(impl)
    torch.manual_seed(42)
    if meta:
        with torch.device("meta"):
            model = _two_tensor_mlps(pre_version)
    else:
        model = _two_tensor_mlps(pre_version)
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard}
    if meta:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if offload:
        kwargs["offload_policy"] = api.CPUOffloadPolicy(pin_memory=False)
    _shard_all(api, model, **kwargs)
    if meta:
        _init_after_to_empty(model)
    return _train(model, 8, {"foreach": True}, accumulate=accumulate)


def _monkey_patch_case(impl: str) -> tuple[dict[str, list[Any]], int]:
    """Methods set on each local tensor after ``to_empty``; returns how often pre ran."""
    api = _api(impl)
    ran = [0]

    def pre(self: Any, mesh: Any, size: Any, stride: Any, module: Any, mp: Any) -> Any:  # noqa: PLR0917
        ran[0] += 1
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def post(self: Any, outputs: Any, metadata: Any, param_dtype: Any, *, out: Any = None) -> Any:
        (t,) = outputs
        assert metadata is None and t.dtype == torch.bfloat16
        if out is not None:
            with _unsafe_preserve_version_counter(out):
                out.copy_(t)
            return None
        up = t.to(param_dtype)
        return up, (t, up)

    with torch.device("meta"):
        model = _plain_two_tensor_mlps()
    _shard_all(api, model)
    _init_after_to_empty(model)
    for name, p in model.named_parameters():
        if "weight" in name:
            local = p._local_tensor
            local.fsdp_pre_all_gather = pre.__get__(local)
            local.fsdp_post_all_gather = post.__get__(local)
    return _train(model, 8, {"foreach": True}), ran[0]


def _outer_size_case(impl: str) -> dict[str, list[Any]]:
    api = _api(impl)
    torch.manual_seed(42)
    model = _subclass_mlp(Bf16Gathered, 3, 3)
    api.fully_shard(model, reshard_after_forward=False)
    # One step, as torch's test: on later gathers the out= copy of a padded output into the
    # unpadded parameter fails in this method (torch's issue 154836), whoever calls it.
    return _train(model, 3, {"foreach": False}, steps=1)


def _int8_case(impl: str, reshard: bool) -> tuple[dict[str, list[Any]], list[tuple[str, int]]]:
    """Trains the int8-gathering MLP and records every all-gather (dtype, bytes out)."""
    api = _api(impl)
    if impl == "ours":
        from tests.fsdp._common import use_native_collectives

        use_native_collectives()
    gathers: list[tuple[str, int]] = []
    native = dist.all_gather_single

    def spy(output: Tensor, input: Tensor, *args: Any, **kwargs: Any) -> Any:
        gathers.append((str(output.dtype), output.numel() * output.element_size()))
        return native(output, input, *args, **kwargs)

    torch.manual_seed(42)
    model = nn.Sequential(*[_subclass_mlp(Int8Gathered, 8, 4, bias=False) for _ in range(2)])
    _shard_all(api, model, reshard_after_forward=reshard)
    dist.all_gather_single = spy  # type: ignore[assignment]
    try:
        record = _train(model, 8, {"foreach": False})
    finally:
        dist.all_gather_single = native
    return record, gathers


# --- the rank functions -----------------------------------------------------------------


def _compare_both(case: Callable[[str], dict[str, list[Any]]]) -> tuple[bool, float]:
    return compare(case("torch"), case("ours"))


def _two_tensor_rank() -> dict[str, tuple[bool, float]]:
    out: dict[str, tuple[bool, float]] = {}
    for version in (1, 2):
        for reshard in (True, False):
            for meta in (False, True):
                case = functools.partial(
                    _two_tensor_case, pre_version=version, reshard=reshard, meta=meta
                )
                out[f"v{version}_reshard_{reshard}_meta_{meta}"] = _compare_both(case)
    offload = functools.partial(_two_tensor_case, pre_version=2, reshard=True, meta=False)
    out["cpu_offload"] = _compare_both(functools.partial(offload, offload=True))
    out["accumulate_no_sync"] = _compare_both(functools.partial(offload, accumulate=2))
    return out


def _monkey_patch_rank() -> tuple[tuple[bool, float], int, int]:
    ref, ran_torch = _monkey_patch_case("torch")
    ours, ran_ours = _monkey_patch_case("ours")
    return compare(ref, ours), ran_torch, ran_ours


def _outer_size_rank() -> tuple[bool, float]:
    return _compare_both(_outer_size_case)


def _hsdp_rank() -> tuple[tuple[bool, float], list[str], list[str]]:
    from torch.distributed.device_mesh import init_device_mesh

    calls = {}
    records = {}
    for impl in ("torch", "ours"):
        Int8Gathered.calls = []
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        api = _api(impl)
        torch.manual_seed(42)
        model = nn.Sequential(*[_subclass_mlp(Int8Gathered, 8, 4, bias=False) for _ in range(2)])
        _shard_all(api, model, mesh=mesh)
        records[impl] = _train(model, 8, {"foreach": False})
        calls[impl] = Int8Gathered.calls
    return compare(records["torch"], records["ours"]), calls["torch"], calls["ours"]


def _int8_rank(reshard: bool) -> dict[str, Any]:
    Int8Gathered.calls = []
    ref, ref_gathers = _int8_case("torch", reshard)
    torch_calls, Int8Gathered.calls = Int8Gathered.calls, []
    ours, our_gathers = _int8_case("ours", reshard)
    return {
        "parity": compare(ref, ours),
        "torch_gathers": ref_gathers,
        "our_gathers": our_gathers,
        "torch_calls": torch_calls,
        "our_calls": Int8Gathered.calls,
    }


def _errors_rank() -> list[str]:
    """The user errors of the contract, each raised on every rank (no rank waits alone in a
    gather): one method without the other, a signature of neither form, an uneven
    parameter's inputs without the padding."""
    import fsdp
    from flatparam import RankDisagreementError

    messages = []

    class OnlyPre(Bf16Gathered):
        @property
        def fsdp_post_all_gather(self) -> Any:  # type: ignore[override]
            raise AttributeError("fsdp_post_all_gather")  # hasattr: False

    with pytest.raises(AssertionError) as info:
        fsdp.fully_shard(_subclass_mlp(OnlyPre, 4, 2))
    messages.append(str(info.value))

    class ThreeArgs(Bf16Gathered):
        def fsdp_pre_all_gather(self, mesh: Any, size: Any, stride: Any) -> Any:  # type: ignore[override]
            return (self._data,), None

    model = _subclass_mlp(ThreeArgs, 4, 2)
    fsdp.fully_shard(model)
    with pytest.raises(AssertionError) as info:
        model(torch.randn(2, 4))
    messages.append(str(info.value))

    class Unpadded(Bf16Gathered):
        def fsdp_pre_all_gather(
            self, mesh: Any, size: Any, stride: Any, module: Any, mp: Any
        ) -> Any:
            return (self._data.to(torch.bfloat16),), None

    model = _subclass_mlp(Unpadded, 3, 3)  # 9 and 3 rows over 2 ranks: uneven
    fsdp.fully_shard(model)
    with pytest.raises(RankDisagreementError) as info:
        model(torch.randn(2, 3))
    messages.append(str(info.value))
    return messages


# --- tests --------------------------------------------------------------------------------


def _assert_equal(results: list[dict[str, tuple[bool, float]]]) -> None:
    for rank, per_case in enumerate(results):
        for name, (equal, worst) in per_case.items():
            assert equal, f"rank {rank}, {name}: differs from torch's by up to {worst:.3g}"


def test_two_tensor_extensions_match_torch() -> None:
    """Both signatures, two inputs per parameter, out= reuse, reshard or not, meta + bf16,
    CPU offload, gradient accumulation without sync."""
    _assert_equal(run_ranks(_two_tensor_rank, 2, timeout=120))


def test_methods_set_on_local_tensors_match_torch() -> None:
    results = run_ranks(_monkey_patch_rank, 2)
    for rank, ((equal, worst), ran_torch, ran_ours) in enumerate(results):
        assert equal, f"rank {rank}: differs from torch's by up to {worst:.3g}"
        assert ran_ours == ran_torch > 0, (ran_torch, ran_ours)


def test_subclass_padding_its_own_chunk_matches_torch() -> None:
    _assert_equal([{"outer_size": r} for r in run_ranks(_outer_size_rank, 2)])


def test_hsdp_passes_the_shard_mesh() -> None:
    for rank, ((equal, worst), torch_calls, our_calls) in enumerate(run_ranks(_hsdp_rank, 4)):
        assert equal, f"rank {rank}: differs from torch's by up to {worst:.3g}"
        pres = {c for c in our_calls if c.startswith("pre")}
        assert pres == {"pre:1:2"}, pres  # the 1-D shard mesh of 2 ranks, as torch's
        assert our_calls == torch_calls


@pytest.mark.parametrize("reshard", [True, False])
def test_gather_moves_the_extension_bytes(reshard: bool) -> None:
    """int8 data + a float32 scale per row (weights only, no biases): each MLP's gather moves
    1 byte per weight element plus 4 per scale row, as bytes, the same gathers as torch's;
    out= on every later gather."""
    for rank, r in enumerate(run_ranks(_int8_rank, 2, reshard)):
        equal, worst = r["parity"]
        assert equal, f"rank {rank}: differs from torch's by up to {worst:.3g}"
        assert r["our_calls"] == r["torch_calls"]
        assert r["our_calls"].count("post:new") == 4  # two weights in each of two MLPs
        assert r["our_calls"].count("post:out") > 0
        # in_proj 32x8 and out_proj 8x32: 512 int8 elements and 32 + 8 scale rows per MLP
        ext_bytes = 2 * 256 + 4 * (32 + 8)
        assert r["our_gathers"] == r["torch_gathers"]
        assert set(r["our_gathers"]) == {("torch.uint8", ext_bytes)}, r["our_gathers"]


def test_contract_errors_name_the_fix_on_every_rank() -> None:
    for rank, (only_pre, signature, unpadded) in enumerate(run_ranks(_errors_rank, 2)):
        assert "Both fsdp_pre_all_gather and fsdp_post_all_gather" in only_pre
        assert f"rank {rank}" in only_pre and "define the other one" in only_pre
        assert "Invalid fsdp_pre_all_gather" in signature and f"rank {rank}" in signature
        # Rank 0's chunk has no padding rows, so only rank 1's method got it wrong: both
        # ranks raise the agreement step's error, which quotes rank 1's.
        assert "padded sharded size" in unpadded and "rank 1: When" in unpadded, unpadded
