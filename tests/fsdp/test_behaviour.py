"""Behaviours around training: summon_full_params, apply, state_dict, model shapes.

One 2-rank spawn runs every check (a module-scoped fixture); each test reads
its part of the result. Each check compares numbers against a reference: the
unwrapped model, or a plain model whose gradients are averaged by hand (the
reference for graphs that DDP itself refuses, such as two forwards before a
backward).
"""

from __future__ import annotations

import dataclasses
import re
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.fsdp._common import (
    Block,
    Net,
    batches,
    fsdp_train,
    full_params,
    loss_fn,
    make_net,
    max_diff,
    reference_train,
)
from tests.ranks import run_ranks

CHECKS: dict[str, Callable[[], Any]] = {}


def check(fn: Callable[[], Any]) -> Callable[[], Any]:
    CHECKS[fn.__name__] = fn
    return fn


def _wrapped(strategy: str = "FULL_SHARD", **kw: Any) -> Any:
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    return fsdp.FullyShardedDataParallel(
        make_net(),
        sharding_strategy=fsdp.ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        **kw,
    )


def _step(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return loss_fn(model(x), y)


@check
def summon_names_values_writeback() -> dict[str, Any]:
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    out: dict[str, Any] = {}
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        model = _wrapped(strategy)
        ref = make_net()
        with FSDP.summon_full_params(model):
            names = [n for n, _ in model.named_parameters()]
            out[f"{strategy}_names_match"] = names == [n for n, _ in ref.named_parameters()]
            out[f"{strategy}_values"] = max_diff(
                dict(model.named_parameters()), dict(ref.named_parameters())
            )
            out[f"{strategy}_buffers"] = [n for n, _ in model.named_buffers()]
            with torch.no_grad():
                model.module.head.weight.fill_(2.0)  # kept (writeback)
        with FSDP.summon_full_params(model, writeback=False):
            out[f"{strategy}_written"] = model.module.head.weight.eq(2.0).all().item()
            with torch.no_grad():
                model.module.head.weight.fill_(3.0)  # discarded when sharded
        with FSDP.summon_full_params(model):
            out[f"{strategy}_after_nowriteback"] = model.module.head.weight.flatten()[0].item()
        # The forward uses the written values: compare with the unwrapped model.
        with torch.no_grad():
            ref.head.weight.fill_(out[f"{strategy}_after_nowriteback"])
        x, _ = batches(1)[0]
        out[f"{strategy}_forward"] = (model(x) - ref(x)).abs().max().item()
    return out


@check
def summon_recurse_rank0_offload() -> dict[str, Any]:
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    model = _wrapped()
    out: dict[str, Any] = {}
    with FSDP.summon_full_params(model, recurse=False):
        out["recurse_false"] = sorted(n for n, _ in model.named_parameters())
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False, offload_to_cpu=True):
        out["rank0_only"] = sorted((n, tuple(p.shape)) for n, p in model.named_parameters())[:2]
        out["rank0_device"] = sorted({p.device.type for p in model.parameters()})
    with FSDP.summon_full_params(model.module.blocks[1]):
        out["inner_only"] = sorted(n for n, _ in model.module.blocks[1].named_parameters())
    return out


@check
def apply_initialises_full_params() -> dict[str, Any]:
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    model = _wrapped()

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            with torch.no_grad():
                m.weight.fill_(0.5)
                m.bias.zero_()

    assert model.apply(init) is model
    with FSDP.summon_full_params(model):
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        return {
            "n_linear": len(linears),
            "all_half": all(bool(m.weight.eq(0.5).all()) for m in linears),
            "bias_zero": all(bool(m.bias.eq(0).all()) for m in linears),
        }


@check
def state_dict_roundtrip() -> dict[str, Any]:
    model = _wrapped()
    ref = make_net()
    sd = model.state_dict()
    out: dict[str, Any] = {
        "keys": list(sd) == list(ref.state_dict()),
        "values": max_diff(sd, ref.state_dict()),
    }
    torch.manual_seed(7)
    other = Net()
    model.load_state_dict(other.state_dict())
    out["loaded"] = max_diff(full_params(model), dict(other.named_parameters()))
    x, _ = batches(1)[0]
    out["loaded_forward"] = (model(x) - other(x)).abs().max().item()
    partial = {k: v for k, v in other.state_dict().items() if not k.startswith("head.")}
    result = model.load_state_dict(partial, strict=False)
    out["missing"] = sorted(result.missing_keys)
    out["unexpected"] = sorted(result.unexpected_keys)
    return out


class Pair(NamedTuple):
    a: Tensor
    b: Tensor


@dataclasses.dataclass
class Out:
    logits: Tensor
    extra: list[Tensor]


class NestedOut(nn.Module):
    """Returns a dict holding a named tuple, a dataclass and a plain int."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: Tensor) -> dict[str, Any]:
        logits = self.net(x)
        return {"pair": Pair(logits, logits * 2), "out": Out(logits, [logits.sum()]), "n": 3}


def _nested_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    o = model(x)
    assert o["n"] == 3
    return loss_fn(o["pair"].a + o["pair"].b, y) + o["out"].extra[0] * 1e-3


@check
def nested_outputs() -> dict[str, Any]:
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    data = batches(4)
    torch.manual_seed(0)
    ref = NestedOut()
    ref_losses = reference_train(ref, data, _nested_loss)
    torch.manual_seed(0)
    model = fsdp.FullyShardedDataParallel(NestedOut(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    losses = fsdp_train(model, data, _nested_loss)
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "param": max_diff(full_params(model), dict(ref.named_parameters())),
    }


class ModeNet(Net):
    """``Net`` whose forward skips a block or discards its output (``mode``)."""

    mode = "skip"

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx) * self.scale
        if self.mode == "unused":
            _ = self.blocks[1](h)  # runs, but its output does not reach the loss
        h = self.blocks[0](h)
        h = self.blocks[2](h)  # in "skip" mode blocks[1] never runs
        return self.head(self.ln_f(h))


def _two_forwards(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return loss_fn(model(x), y) + 0.5 * loss_fn(model(x.flip(0)), y)


def _mode_net(mode: str) -> Net:
    torch.manual_seed(0)
    net = ModeNet() if mode != "twice" else Net()
    if isinstance(net, ModeNet):
        net.mode = mode
    return net


@check
def unusual_graphs() -> dict[str, Any]:
    """Unused units, outputs that do not reach the loss, two forwards per backward."""
    import fsdp
    from fsdp._wrapper._flat_param_unit import ShardState
    from fsdp.wrap import ModuleWrapPolicy

    out: dict[str, Any] = {}
    data = batches(4)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        for mode in ("skip", "unused", "twice"):
            step = _two_forwards if mode == "twice" else _step
            ref = _mode_net(mode)
            ref_losses = reference_train(ref, data, step)
            model = fsdp.FullyShardedDataParallel(
                _mode_net(mode),
                sharding_strategy=fsdp.ShardingStrategy[strategy],
                auto_wrap_policy=ModuleWrapPolicy({Block}),
            )
            losses = fsdp_train(model, data, step)
            states = {s.unit.state for s in model._fsdp_state.ctx.states if s.unit is not None}
            out[f"{strategy}_{mode}"] = (
                max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
                max_diff(full_params(model), dict(ref.named_parameters())),
                states == {ShardState.SHARDED},
            )
    return out


@check
def eval_between_steps() -> dict[str, Any]:
    from fsdp._wrapper._flat_param_unit import ShardState

    data = batches(4)
    out: dict[str, Any] = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        ref = make_net()
        model = _wrapped(strategy)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        worst = 0.0
        for x, y in data:
            loss_fn(ref(x), y).backward()
            from tests.fsdp._common import average_grads

            average_grads(ref)
            loss_fn(model(x), y).backward()
            with torch.no_grad():  # evaluation between backward and step
                worst = max(worst, (model(x) - ref(x)).abs().max().item())
            states = {s.unit.state for s in model._fsdp_state.ctx.states if s.unit is not None}
            ref_opt.step()
            opt.step()
            ref_opt.zero_grad()
            opt.zero_grad()
            with torch.no_grad():
                worst = max(worst, (model(x) - ref(x)).abs().max().item())
        out[strategy] = (worst, states == {ShardState.SHARDED} or strategy == "NO_SHARD")
        out[f"{strategy}_param"] = max_diff(full_params(model), dict(ref.named_parameters()))
    return out


@check
def tied_and_frozen() -> dict[str, Any]:
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    data = batches(4)
    out: dict[str, Any] = {}

    def tied() -> Net:
        net = make_net()
        net.emb.weight = net.head.weight  # tied embeddings in the root unit (13 x 6 both)
        return net

    ref = tied()
    ref_losses = reference_train(ref, data, _step)
    model = fsdp.FullyShardedDataParallel(tied(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    losses = fsdp_train(model, data, _step)
    out["tied"] = (
        max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        max_diff(full_params(model), dict(ref.named_parameters())),
    )
    with fsdp.FullyShardedDataParallel.summon_full_params(model):
        out["tied_alias"] = model.module.emb.weight is model.module.head.weight

    def frozen() -> Net:
        net = make_net()
        net.blocks[1].requires_grad_(False)
        return net

    ref = frozen()
    ref_losses = reference_train(ref, data, _step)
    model = fsdp.FullyShardedDataParallel(frozen(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    losses = fsdp_train(model, data, _step)
    out["frozen"] = (
        max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        max_diff(full_params(model), dict(ref.named_parameters())),
        model.module.blocks[1]._flat_param.grad is None,
        model.module.blocks[1]._flat_param.requires_grad,
    )
    return out


@check
def comm_hooks() -> dict[str, Any]:
    from torch.distributed.algorithms._comm_hooks import default_hooks

    data = batches(4)
    out: dict[str, Any] = {}
    base = _wrapped()
    base_losses = fsdp_train(base, data, _step)
    for strategy, hook in (
        ("FULL_SHARD", default_hooks.reduce_scatter_hook),
        ("NO_SHARD", default_hooks.allreduce_hook),
    ):
        model = _wrapped(strategy)
        model.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD), hook)
        losses = fsdp_train(model, data, _step)
        out[strategy] = (
            max(abs(a - b) for a, b in zip(losses, base_losses, strict=True)),
            max_diff(full_params(model), full_params(base)),
        )

    def user_hook(group: Any, grad: Tensor, output: Tensor) -> None:
        # A user's own reduction: sum, then average (torch's bf16 hook needs CUDA streams).
        dist.reduce_scatter_tensor(output, grad, group=group)
        output.div_(dist.get_world_size(group))

    model = _wrapped()
    model.register_comm_hook(dist.group.WORLD, user_hook)
    losses = fsdp_train(model, data, _step)
    out["user"] = (
        max(abs(a - b) for a, b in zip(losses, base_losses, strict=True)),
        max_diff(full_params(model), full_params(base)),
    )
    state = default_hooks.DefaultState(dist.group.WORLD)
    # torch's FSDP raises AssertionError for both; ours raised RuntimeError: both catch them.
    try:
        model.register_comm_hook(state, default_hooks.reduce_scatter_hook)
        out["twice"] = "no error"
    except AssertionError as e:
        assert isinstance(e, RuntimeError)
        out["twice"] = str(e)
    try:
        model.module.blocks[0].register_comm_hook(state, default_hooks.reduce_scatter_hook)
        out["nested"] = "no error"
    except AssertionError as e:
        assert isinstance(e, RuntimeError)
        out["nested"] = str(e)
    return out


@check
def module_surface() -> dict[str, Any]:
    import fsdp
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    model = _wrapped()
    out: dict[str, Any] = {
        "forwarded_attr": model.emb is model.module.emb,
        "module": type(model.module).__name__,
        "n_fsdp": len(FSDP.fsdp_modules(model)),
        "n_roots": len(FSDP.fsdp_modules(model, root_only=True)),
        "root": model.check_is_root(),
        "inner_root": model.module.blocks[0].check_is_root(),
        "param_names": [n for n, _ in model.named_parameters()][:2],
    }
    seq = FSDP(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    out["indexing"] = type(seq[1]).__name__
    x, _ = batches(1)[0]
    model(x)  # forward only: FULL_SHARD frees the inner units' parameters
    inner = model.module.blocks[1].module.fc1
    out["placeholder"] = (inner.weight.device.type, tuple(inner.weight.shape))
    out["repr_ok"] = "FullyShardedDataParallel" in repr(model)
    out["state"] = model.training_state.name
    out["version"] = fsdp.__version__
    return out


def _rank_behaviour() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, fn in CHECKS.items():
        try:
            results[name] = fn()
        except Exception:
            results[name] = "FAILED:\n" + traceback.format_exc()
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_rank_behaviour, 2, timeout=240)


def _get(results: list[dict[str, Any]], name: str) -> list[Any]:
    out = [r[name] for r in results]
    for r in out:
        assert not (isinstance(r, str) and r.startswith("FAILED")), r
    return out


def test_summon_full_params(results: list[dict[str, Any]]) -> None:
    for r in _get(results, "summon_names_values_writeback"):
        for strategy in ("FULL_SHARD", "NO_SHARD"):
            assert r[f"{strategy}_names_match"], r
            assert r[f"{strategy}_values"] == 0.0, r
            assert r[f"{strategy}_buffers"] == ["scale"], r
            assert r[f"{strategy}_written"], r
            assert r[f"{strategy}_forward"] < 1e-6, r
        assert r["FULL_SHARD_after_nowriteback"] == 2.0, r  # writeback=False discarded
        assert r["NO_SHARD_after_nowriteback"] == 3.0, r  # unsharded: persists regardless


def test_summon_options(results: list[dict[str, Any]]) -> None:
    r0, r1 = _get(results, "summon_recurse_rank0_offload")
    for r in (r0, r1):
        # recurse=False: the root's own parameters only; nested units stay flat.
        assert r["recurse_false"] == [
            "blocks.0._flat_param",
            "blocks.1._flat_param",
            "blocks.2._flat_param",
            "emb.weight",
            "head.bias",
            "head.weight",
            "ln_f.bias",
            "ln_f.weight",
        ], r
        assert r["inner_only"] == [
            "fc1.bias",
            "fc1.weight",
            "fc2.bias",
            "fc2.weight",
            "ln.bias",
            "ln.weight",
        ]
    assert r0["rank0_only"] == [("blocks.0.fc1.bias", (13,)), ("blocks.0.fc1.weight", (13, 6))]
    assert r0["rank0_device"] == ["cpu"]
    assert r1["rank0_only"][0][0] == "_flat_param"  # other ranks keep their shards


def test_apply(results: list[dict[str, Any]]) -> None:
    for r in _get(results, "apply_initialises_full_params"):
        assert r == {"n_linear": 7, "all_half": True, "bias_zero": True}


def test_state_dict(results: list[dict[str, Any]]) -> None:
    for r in _get(results, "state_dict_roundtrip"):
        assert r["keys"] and r["values"] == 0.0, r
        assert r["loaded"] == 0.0 and r["loaded_forward"] < 1e-6, r
        assert r["missing"] == ["head.bias", "head.weight"], r
        assert r["unexpected"] == [], r


def test_nested_outputs(results: list[dict[str, Any]]) -> None:
    for r in _get(results, "nested_outputs"):
        assert r["loss"] == 0.0 and r["param"] == 0.0, r


def test_unused_units_and_two_forwards(results: list[dict[str, Any]]) -> None:
    for r in _get(results, "unusual_graphs"):
        for key, (loss, param, all_sharded) in r.items():
            assert loss < 1e-6 and param < 1e-6, (key, r)
            assert all_sharded, (key, r)


def test_no_grad_eval_between_steps(results: list[dict[str, Any]]) -> None:
    for r in _get(results, "eval_between_steps"):
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            worst, all_sharded = r[strategy]
            assert worst < 1e-6 and all_sharded, (strategy, r)
            assert r[f"{strategy}_param"] == 0.0, r


def test_tied_and_frozen(results: list[dict[str, Any]]) -> None:
    for r in _get(results, "tied_and_frozen"):
        assert r["tied"][0] < 1e-6 and r["tied"][1] < 1e-6, r
        assert r["tied_alias"], r
        loss, param, no_grad, requires_grad = r["frozen"]
        assert loss < 1e-6 and param < 1e-6 and no_grad and not requires_grad, r


def test_comm_hooks(results: list[dict[str, Any]]) -> None:
    for r in _get(results, "comm_hooks"):
        assert r["FULL_SHARD"] == (0.0, 0.0), r  # torch's hooks divide the same way
        assert r["NO_SHARD"][0] < 1e-6 and r["NO_SHARD"][1] < 1e-6, r
        assert r["user"] == (0.0, 0.0), r
        assert r["twice"].startswith("A communication hook is already registered"), r
        # torch's text exactly: torch's own tests match it with ^...$.
        assert re.fullmatch(
            "register_comm_hook can only be called on a root instance.", r["nested"]
        )


def test_module_surface(results: list[dict[str, Any]]) -> None:
    for r in _get(results, "module_surface"):
        assert r["forwarded_attr"] and r["module"] == "Net", r
        assert r["n_fsdp"] == 4 and r["n_roots"] == 1, r
        assert r["root"] and not r["inner_root"], r
        assert r["param_names"] == ["_flat_param", "_fsdp_wrapped_module.blocks.0._flat_param"], r
        assert r["indexing"] == "Linear", r
        assert r["placeholder"] == ("meta", (13, 6)), r
        assert r["repr_ok"] and r["state"] == "IDLE", r
