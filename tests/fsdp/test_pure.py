"""Single-process tests of the pieces that need no process group.

The collectives degenerate to copies for a group of one, so a FlatParamUnit
with ``world_size=1`` runs its whole state machine (storage freed and
reallocated, views, gradient reduction) here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn

from fsdp import MixedPrecision
from fsdp._runtime._collectives import all_gather_into, gradient_divide_factors, reduce_scatter_into
from fsdp._runtime._common import apply_to_tensors, cast_floating_tensors, clean_fqn
from fsdp._runtime._exec_order import ExecOrder
from fsdp._wrapper._flat_param_unit import FlatParamUnit, ShardState, UnitConfig
from fsdp._wrapper._init import collect_unit_params
from fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _auto_wrap,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)
from tests.fsdp._common import Block, Net

# ----------------------------------------------------------------- collectives and helpers


@pytest.mark.parametrize(
    ("world_size", "expected"),
    [(1, (1.0, 1.0)), (2, (2.0, 1.0)), (4, (2.0, 2.0)), (8, (4.0, 2.0)), (6, (4.0, 1.5))],
)
def test_gradient_divide_factors(world_size: int, expected: tuple[float, float]) -> None:
    pre, post = gradient_divide_factors(world_size)
    assert (pre, post) == expected
    assert pre * post == world_size


def test_gradient_divide_factors_rejects_zero() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        gradient_divide_factors(0)


def test_collectives_of_one_rank_copy() -> None:
    out = torch.zeros(4)
    pending = all_gather_into(out, torch.arange(4.0), group=None)
    pending.wait()
    assert pending.done and out.tolist() == [0, 1, 2, 3]
    out2 = torch.zeros(4)
    reduce_scatter_into(out2, torch.arange(4.0), group=None).wait()
    assert out2.tolist() == [0, 1, 2, 3]


def test_exec_order() -> None:
    order: ExecOrder[str] = ExecOrder()
    # First forward: nothing recorded, nothing issued ahead; a unit run twice counts once.
    order.start_forward()
    assert [order.forward_step(k) for k in ["root", "a", "b", "a"]] == [None] * 4
    for key in ["a", "b", "a", "root"]:
        order.record_post_forward(key)
    assert order.end_forward(record=True)
    assert order.forward_order == ["root", "a", "b"]
    # Backward order: this iteration's reversed post-forward order.
    assert order.next_backward("root") == "b"
    assert order.next_backward("b") == "a"
    assert order.next_backward("a") is None
    order.end_backward()
    assert order.next_backward("root") is None
    # Same order again: each unit names the next one; the last none.
    order.start_forward()
    assert [order.forward_step(k) for k in ["root", "a", "a", "b"]] == ["a", "b", None, None]
    assert not order.end_forward(record=True)
    assert order.changes == 0
    # A branch: "c" instead of "a". Diverged from there on; the new order is kept.
    order.start_forward()
    assert order.forward_step("root") == "a"
    assert order.forward_step("c") is None
    assert order.diverged
    assert order.forward_step("b") is None  # matches position 2, but the forward diverged
    assert order.end_forward(record=True)
    assert order.forward_order == ["root", "c", "b"] and order.changes == 1
    # Fewer units than recorded: a change; a forward without gradients is not recorded.
    order.start_forward()
    assert order.forward_step("root") == "c"
    assert order.end_forward(record=False)
    assert order.forward_order == ["root", "c", "b"]
    order.start_forward()
    assert order.forward_step("root") == "c"
    assert order.end_forward(record=True)
    assert order.forward_order == ["root"] and order.changes == 2


class Pair(NamedTuple):
    x: Tensor
    y: Any


@dataclasses.dataclass
class DC:
    t: Tensor
    n: int


class ODC(OrderedDict[str, Any]):
    pass


def test_apply_to_tensors_keeps_structure() -> None:
    t = torch.ones(2)
    obj = {"a": [t, (t, 3)], "p": Pair(t, {"k": t}), "d": DC(t, 5), "s": "str"}
    out = apply_to_tensors(lambda x: x * 2, obj)
    assert out["a"][0].tolist() == [2, 2] and out["a"][1][1] == 3
    assert isinstance(out["p"], Pair) and out["p"].y["k"].tolist() == [2, 2]
    assert isinstance(out["d"], DC) and out["d"].t.tolist() == [2, 2] and out["d"].n == 5
    assert out["s"] == "str"


def test_cast_floating_tensors() -> None:
    args, kwargs = cast_floating_tensors(
        torch.bfloat16, (torch.ones(2), torch.ones(2, dtype=torch.long)), {"m": torch.ones(1)}
    )
    assert args[0].dtype == torch.bfloat16 and args[1].dtype == torch.long
    assert kwargs["m"].dtype == torch.bfloat16
    same = (torch.ones(1),)
    assert cast_floating_tensors(None, same, {})[0] is same


def test_clean_fqn() -> None:
    assert clean_fqn("_fsdp_wrapped_module.a._fsdp_wrapped_module.b") == "a.b"


# ----------------------------------------------------------------- FlatParamUnit, one rank


def _unit(module: nn.Module, **overrides: Any) -> FlatParamUnit:
    infos, params, shared, _ = collect_unit_params(module, lambda m: False)
    config = UnitConfig(
        **{
            "group": None,
            "rank": 0,
            "world_size": 1,
            "shard": True,
            "reshard_after_forward": True,
            "compute_device": torch.device("cpu"),
            "param_dtype": None,
            "reduce_dtype": None,
            "keep_low_precision_grads": False,
            "offload_params": False,
            **overrides,
        }
    )
    return FlatParamUnit(infos, params, shared, config)


def test_unit_life_cycle_and_autograd_across_a_free() -> None:
    torch.manual_seed(0)
    ref = Block()
    module = Block()
    module.load_state_dict(ref.state_dict())
    unit = _unit(module)
    assert unit.state is ShardState.SHARDED
    assert "weight" not in module.fc1._parameters
    assert module.fc1.weight.device.type == "meta" and module.fc1.weight.shape == (13, 6)
    assert unit.unsharded_storage_bytes() == 0
    with pytest.raises(AssertionError, match="call unshard"):
        unit.wait_for_unshard()

    unit.unshard()
    assert unit.state is ShardState.UNSHARDING
    unit.wait_for_unshard()
    unit.use_unsharded_views()
    assert unit.unsharded_storage_bytes() == unit.layout.padded_numel * 4
    x = torch.randn(3, 6)
    out = module(x)
    # Free the gathered storage between forward and backward, then gather again:
    # autograd's saved views see the refilled storage ([Note: storage resizing and autograd]).
    unit.reshard()
    assert unit.unsharded_storage_bytes() == 0 and module.fc1.weight.device.type == "meta"
    unit.unshard()
    unit.wait_for_unshard()
    out.sum().backward()
    ref(x).sum().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    assert torch.equal(unit.compute_param.grad, expected)

    pending = unit.reduce_grad()
    assert pending is not None
    unit.finish_reduce_grad(pending)
    assert unit.compute_param.grad is None
    assert torch.equal(unit.flat_param.grad, expected)  # one rank: no padding, no division
    unit.reshard()
    assert unit.state is ShardState.SHARDED


def test_unit_mixed_precision_and_keep_low_precision() -> None:
    module = Block()
    unit = _unit(module, param_dtype=torch.bfloat16)
    assert unit.flat_param.dtype == torch.float32
    assert unit.compute_param.dtype == torch.bfloat16 and unit.reduce_dtype == torch.bfloat16
    unit.unshard()
    unit.wait_for_unshard()
    unit.use_unsharded_views()
    module(torch.randn(2, 6, dtype=torch.bfloat16)).sum().backward()
    pending = unit.reduce_grad()
    assert pending is not None
    unit.finish_reduce_grad(pending)
    assert unit.flat_param.grad is not None and unit.flat_param.grad.dtype == torch.float32

    keep = _unit(Block(), param_dtype=torch.bfloat16, keep_low_precision_grads=True)
    keep.unshard()
    keep.wait_for_unshard()
    keep.use_unsharded_views()
    keep.compute_param.grad = torch.ones_like(keep.compute_param)
    pending = keep.reduce_grad()
    assert pending is not None
    keep.finish_reduce_grad(pending)
    assert keep.flat_param.grad is not None and keep.flat_param.grad.dtype == torch.bfloat16


def test_unit_aliased_no_shard_and_summon_helpers() -> None:
    module = Block()
    values = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    unit = _unit(module, shard=False, reshard_after_forward=False)
    assert unit.aliased and unit.compute_param is unit.flat_param
    full = unit.gather_full_precision()
    assert torch.equal(full, values) and full.data_ptr() == unit.flat_param.data_ptr()
    params = unit.register_full_params(full)
    assert module.fc1._parameters["weight"] is params[2]
    unit.unregister_full_params()
    assert "weight" not in module.fc1._parameters


def test_collect_unit_params_shared_and_nested() -> None:
    net = Net()
    net.emb.weight = net.head.weight
    infos, params, shared, visited = collect_unit_params(net, lambda m: isinstance(m, Block))
    names = [f"{i.module_name}.{i.param_name}" for i in infos]
    assert "head.weight" not in names and "emb.weight" in names  # tied: taken once
    assert [(s.module_name, s.param_name, s.prim_module_name) for s in shared] == [
        ("head", "weight", "emb")
    ]
    assert not any(n.startswith("blocks") for n in names)  # nested units skipped
    assert len(params) == len(infos) and net.blocks[0] not in visited


# ----------------------------------------------------------------- wrap policies


class Recorder(nn.Module):
    """Stands in for the FSDP class: records what the policy wrapped and with what."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.inner = module
        self.kwargs = kwargs


def _wrapped_names(model: nn.Module) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, Recorder))


def _run(policy: Any, model: nn.Module, **root_kwargs: Any) -> nn.Module:
    _auto_wrap(
        model,
        policy,
        root_kwargs={"mixed_precision": None, **root_kwargs},
        wrapper_cls=Recorder,
        is_wrapped=lambda m: isinstance(m, Recorder),
    )
    return model


def test_module_wrap_policy_and_transformer_policy() -> None:
    expected = ["blocks.0", "blocks.1", "blocks.2"]
    assert _wrapped_names(_run(ModuleWrapPolicy({Block}), Net())) == expected
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    assert _wrapped_names(_run(policy, Net())) == expected
    lam = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Block))
    assert _wrapped_names(_run(lam, Net())) == expected
    assert "ModuleWrapPolicy" in repr(ModuleWrapPolicy({Block}))


def test_custom_policy_overrides_kwargs() -> None:
    policy = CustomPolicy(
        lambda m: {"sharding_strategy": "X"} if m is model.head else isinstance(m, Block)
    )
    model = Net()
    _run(policy, model, sharding_strategy="FULL")
    assert _wrapped_names(model) == ["blocks.0", "blocks.1", "blocks.2", "head"]
    assert model.head.kwargs["sharding_strategy"] == "X"
    assert model.blocks[0].kwargs["sharding_strategy"] == "FULL"
    with pytest.raises(ValueError, match="must return a bool or a dict"):
        _run(CustomPolicy(lambda m: 3), Net())  # type: ignore[arg-type,return-value]


def test_size_based_policy_counts_unwrapped_numel() -> None:
    # Each Block has 6*13+13 + 13*6+6 + 12 = 187 parameters.
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=150)
    model = _run(policy, Net())
    assert _wrapped_names(model) == ["blocks.0", "blocks.1", "blocks.2"]
    big = functools.partial(size_based_auto_wrap_policy, min_num_params=10_000)
    assert _wrapped_names(_run(big, Net())) == []
    # Containers are never wrapped even when large; their children are.
    assert not size_based_auto_wrap_policy(nn.ModuleList(), recurse=False, nonwrapped_numel=10**9)


def test_always_wrap_policy_and_root_excluded() -> None:
    model = _run(always_wrap_policy, nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert _wrapped_names(model) == ["0", "1"]  # every child; never the root itself


def test_mixed_precision_wraps_batch_norm_alone_in_fp32() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    _run(ModuleWrapPolicy({nn.Linear}), model, mixed_precision=mp)
    assert _wrapped_names(model) == ["0", "1", "2"]
    assert model[1].kwargs["mixed_precision"] is None
    assert model[0].kwargs["mixed_precision"] is mp
    bn = model[1].inner
    out = bn(torch.randn(5, 4, dtype=torch.bfloat16))  # runs in fp32, returns the input dtype
    assert out.dtype == torch.bfloat16


def test_auto_wrap_refuses_wrapped_modules() -> None:
    model = nn.Sequential(Recorder(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"'0' .*is already an FSDP instance"):
        _run(always_wrap_policy, model)
    with pytest.raises(TypeError, match="auto_wrap_policy must be"):
        _run(3, nn.Sequential(nn.Linear(2, 2)))


def test_enable_wrap() -> None:
    lin = nn.Linear(2, 2)
    assert wrap(lin) is lin  # outside the context: unchanged
    with enable_wrap(wrapper_cls=Recorder, a=1):
        w = wrap(nn.Linear(2, 2), b=2)
        assert isinstance(w, Recorder) and w.kwargs == {"a": 1, "b": 2}
        with (
            pytest.raises(NotImplementedError, match="nested enable_wrap"),
            enable_wrap(wrapper_cls=Recorder),
        ):
            pass
    assert wrap(lin) is lin


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_forward_issues_ahead_by_default_on_every_device(device: str) -> None:
    # [Note: issue-ahead]: the default issues ahead on CUDA too, since our gathers
    # wait for the compute stream; on entry only without both flags.
    from fsdp._wrapper._fsdp_state import FSDPState

    def issue_ahead(forward_prefetch: bool, limit_all_gathers: bool) -> bool:
        state = FSDPState(
            nn.Linear(2, 2),
            None,
            compute_device=torch.device(device),
            mixed_precision=MixedPrecision(),
            backward_prefetch=None,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
        )
        return state.issue_ahead

    assert issue_ahead(False, True) and issue_ahead(True, True) and issue_ahead(True, False)
    assert not issue_ahead(False, False)
