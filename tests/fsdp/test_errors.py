"""Every bad input and wrong-state call gives a clear error naming the problem and the fix.

Argument checks that run before the process group is touched are tested in
this process; the rest share one 2-rank spawn, where each case returns the
exception it raised (type and message) for the test to match.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision
from fsdp._wrapper._init import CudaUnavailableError
from tests.fsdp._common import Block, batches, loss_fn, make_net
from tests.ranks import run_ranks

# ----------------------------------------------------------------- no process group needed


def test_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"call torch\.distributed\.init_process_group"):
        FullyShardedDataParallel(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {"sharding_strategy": "FULL_SHARD"},
            TypeError,
            r"must be fsdp\.ShardingStrategy or torch\.distributed\.fsdp",
        ),
        (
            {"mixed_precision": torch.bfloat16},
            TypeError,
            r"must be fsdp\.MixedPrecision or torch\.distributed\.fsdp",
        ),
        (
            {"cpu_offload": True},
            TypeError,
            r"must be fsdp\.CPUOffload or torch\.distributed\.fsdp",
        ),
        (
            {"backward_prefetch": "BACKWARD_PRE"},
            TypeError,
            r"must be fsdp\.BackwardPrefetch or torch\.distributed\.fsdp",
        ),
    ],
)
def test_argument_errors(kwargs: dict[str, Any], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        FullyShardedDataParallel(nn.Linear(2, 2), **kwargs)


def test_config_validation() -> None:
    with pytest.raises(TypeError, match=r"param_dtype must be a torch\.dtype or None, got 'bf16'"):
        MixedPrecision(param_dtype="bf16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"_module_classes_to_ignore must hold nn\.Module"):
        MixedPrecision(_module_classes_to_ignore=(int,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"wraps an nn\.Module, got int"):
        FullyShardedDataParallel(3)  # type: ignore[arg-type]
    assert CPUOffload().offload_params is False


# ----------------------------------------------------------------- inside ranks

CASES: dict[str, Callable[[], Any]] = {}


def case(fn: Callable[[], Any]) -> Callable[[], Any]:
    CASES[fn.__name__] = fn
    return fn


def _wrapped(**kw: Any) -> FullyShardedDataParallel:
    from fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(make_net(), auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)


@case
def wrap_twice() -> None:
    FullyShardedDataParallel(FullyShardedDataParallel(nn.Linear(2, 2)))


@case
def wrap_submodule_of_wrapped() -> None:
    net = make_net()
    FullyShardedDataParallel(net)
    FullyShardedDataParallel(net.blocks[0])


@case
def auto_wrap_over_wrapped() -> None:
    from fsdp.wrap import ModuleWrapPolicy

    net = make_net()
    net.blocks[0] = FullyShardedDataParallel(net.blocks[0])
    FullyShardedDataParallel(net, auto_wrap_policy=ModuleWrapPolicy({Block}))


@case
def optimizer_before_wrapping() -> None:
    net = make_net()
    opt = torch.optim.AdamW(net.parameters())
    model = FullyShardedDataParallel(net)
    x, y = batches(1)[0]
    loss_fn(model(x), y).backward()
    opt.step()


@case
def no_sync_on_nested() -> None:
    model = _wrapped()
    with model.module.blocks[0].no_sync():
        pass


@case
def clip_on_nested() -> None:
    model = _wrapped()
    model.module.blocks[0].clip_grad_norm_(1.0)


@case
def no_sync_during_forward() -> None:
    model = _wrapped()
    model.module.head.register_forward_hook(lambda *a: model.no_sync().__enter__())
    model(batches(1)[0][0])


@case
def clip_during_backward() -> None:
    model = _wrapped()
    x, y = batches(1)[0]
    out = model(x)
    out.register_hook(lambda g: model.clip_grad_norm_(1.0))
    loss_fn(out, y).backward()


@case
def summon_during_forward() -> None:
    model = _wrapped()

    def hook(*args: Any) -> None:
        with FullyShardedDataParallel.summon_full_params(model):
            pass

    model.module.head.register_forward_hook(hook)
    model(batches(1)[0][0])


@case
def forward_inside_summon() -> None:
    model = _wrapped()
    with FullyShardedDataParallel.summon_full_params(model):
        model(batches(1)[0][0])


@case
def summon_with_grads() -> None:
    with FullyShardedDataParallel.summon_full_params(_wrapped(), with_grads=True):
        pass


@case
def summon_rank0_writeback() -> None:
    with FullyShardedDataParallel.summon_full_params(_wrapped(), rank0_only=True):
        pass


@case
def mixed_dtypes_in_unit() -> None:
    net = make_net()
    net.head.double()
    FullyShardedDataParallel(net)


@case
def double_backward() -> None:
    model = _wrapped()
    x, y = batches(1)[0]
    loss_fn(model(x), y).backward(create_graph=True)


@case
def int_device_without_cuda() -> None:
    if torch.cuda.is_available():
        raise CudaUnavailableError(
            "names a CUDA device but CUDA is not available (not checkable: CUDA present)"
        )
    try:
        FullyShardedDataParallel(nn.Linear(2, 2), device_id=0)
    except RuntimeError as e:  # torch's type for it; ours is a subclass
        assert isinstance(e, CudaUnavailableError)
        raise


@case
def comm_hook_not_callable() -> None:
    _wrapped().register_comm_hook(None, 3)  # type: ignore[arg-type]


@case
def inner_used_as_root_first() -> None:
    net = make_net()
    net.blocks[0] = FullyShardedDataParallel(net.blocks[0])
    x = torch.randn(2, 5, 6)
    net.blocks[0](x)  # the inner instance runs (and becomes a root) on its own
    model = FullyShardedDataParallel(net)
    model(batches(1)[0][0])


EXPECTED: dict[str, tuple[str, str]] = {
    "wrap_twice": ("ValueError", "already wrapped by FullyShardedDataParallel"),
    "wrap_submodule_of_wrapped": ("ValueError", "already managed by an FSDP instance"),
    "auto_wrap_over_wrapped": ("ValueError", "'blocks.0' .* is already an FSDP instance"),
    "optimizer_before_wrapping": ("RuntimeError", "created before the model was wrapped"),
    "no_sync_on_nested": (
        "RuntimeError",
        r"^`no_sync\(\)` on inner FSDP instances is not supported\. Please call `no_sync\(\)` on "
        r"root FSDP module\.: this FSDP instance is nested .* call it on the outermost",
    ),
    "clip_on_nested": (
        "RuntimeError",
        r"^`clip_grad_norm_\(\)` should only be called on the root FSDP instance: .*nested",
    ),
    "no_sync_during_forward": ("TrainingStateError", "running inside a forward or backward pass"),
    "clip_during_backward": ("TrainingStateError", "running inside a forward or backward pass"),
    "summon_during_forward": (
        "_SummonStateError",  # a TrainingStateError and, as torch's, an AssertionError
        "^Cannot manually unshard parameters during forward/backward: summon_full_params needs "
        ".* IDLE.*forward or backward.*expected to be in states",
    ),
    "forward_inside_summon": (
        "TrainingStateError",
        r"forward needs .* inside summon_full_params\(\).*expected to be in states "
        r"\['IDLE', 'FORWARD_BACKWARD'\] but current state is SUMMON_FULL_PARAMS",
    ),
    "summon_with_grads": (
        "NotImplementedError",
        "with_grads=True.* use_orig_params=True.*is not supported yet",
    ),
    "summon_rank0_writeback": (
        "_RankZeroWritebackError",
        "writeback=True and rank0_only=True is not supported yet.*Pass writeback=False",
    ),
    "mixed_dtypes_in_unit": ("ValueError", r"must share one dtype.*torch\.float64: head\.weight"),
    "double_backward": ("RuntimeError", "gradients of gradients"),
    "int_device_without_cuda": ("CudaUnavailableError", "names a CUDA device but CUDA is not"),
    "comm_hook_not_callable": ("ValueError", "^The communication hook must be callable but got 3"),
    "inner_used_as_root_first": ("RuntimeError", "already ran as a root"),
}


def _rank_errors() -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for name, fn in CASES.items():
        try:
            fn()
            out[name] = ("no error", "")
        except Exception as e:  # the case under test
            out[name] = (type(e).__name__, str(e) + "\n" + traceback.format_exc(limit=-3))
        dist.barrier()
    return out


def test_error_messages() -> None:
    assert sorted(CASES) == sorted(EXPECTED)
    for out in run_ranks(_rank_errors, 2, timeout=120):
        for name, (etype, pattern) in EXPECTED.items():
            got_type, message = out[name]
            assert got_type == etype, (name, got_type, message)
            assert re.search(pattern, message, re.DOTALL), (name, pattern, message)
