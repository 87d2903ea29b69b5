"""Forward issue-ahead: the next unit's all-gather starts before the current unit computes.

See [Note: issue-ahead] in ``fsdp/_root_context.py`` and [Note: forward order
and its changes] in ``fsdp/_exec_order.py``. Each rank records, during the
forward passes, two kinds of events in the order they happen: ``issue X``
when the all-gather of unit X is called (it returns at once; gloo runs it on
its own thread) and ``compute X`` when X's module starts computing (a forward
pre-hook on the wrapped module). From them the tests check:

- the order of issue and compute per configuration: with the defaults on the
  CPU (and with ``forward_prefetch=True``) every unit's all-gather is issued
  before the unit before it computes, from the second iteration on; with
  ``limit_all_gathers=False`` each unit gathers on entry (torch's FSDP1 on
  the CPU); the losses are the same bit for bit either way;
- memory: at every event at most two units besides the root hold gathered
  parameters, and no unit but the root after a forward;
- a forward whose order differs from the previous one (a conditional branch
  switched on and off, the same on every rank) falls back to gathering on
  demand where it diverges, trains exactly as a plain model with averaged
  gradients, and every rank issues the same all-gathers in the same order;
  forwards without gradients (evaluation) with either order give the plain
  model's outputs, leave nothing gathered and do not change the order.
World sizes 2 and 4; about 5 s in all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.fsdp._common import (
    Block,
    average_grads,
    batches,
    full_params,
    loss_fn,
    make_net,
    max_diff,
)
from tests.ranks import run_ranks

N_BLOCKS = 4


class Recorder:
    """Issue/compute events of the FSDP units of one model, while ``active``."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.names: dict[int, str] = {}  # id(unit's gather output) -> unit name
        self.events: list[str] = []
        self.active = False
        self.max_gathered = 0  # most non-root units holding gathered parameters at an event
        for s in model._fsdp_state.ctx.states:
            inner = s.module._fsdp_wrapped_module
            name = "root" if s.is_root else _name(model, s.module)
            self.names[id(s.unit.storage.gathered)] = name
            inner.register_forward_pre_hook(self._compute_hook(name))

    def _compute_hook(self, name: str) -> Callable[..., None]:
        def hook(*args: Any) -> None:
            self.event(f"compute {name}")

        return hook

    def event(self, what: str) -> None:
        if not self.active:
            return
        self.events.append(what)
        self.max_gathered = max(self.max_gathered, len(self.gathered()))

    def gathered(self) -> list[str]:
        from fsdp._wrapper._flat_param_unit import ShardState

        return [
            self.names[id(s.unit.storage.gathered)]
            for s in self.model._fsdp_state.ctx.states
            if not s.is_root and s.unit.state is not ShardState.SHARDED
        ]

    @contextmanager
    def spying(self) -> Iterator[None]:
        """Record an ``issue`` event at every all-gather of a unit's parameters."""
        import fsdp._runtime._sharded_storage as fpu

        original = fpu.all_gather_into

        def spy(out: Tensor, inp: Tensor, group: Any) -> Any:
            name = self.names.get(id(out))
            pending = original(out, inp, group)
            if name is not None:
                self.event(f"issue {name}")
            return pending

        fpu.all_gather_into = spy  # type: ignore[assignment]
        try:
            yield
        finally:
            fpu.all_gather_into = original  # type: ignore[assignment]

    def forward(self, *args: Any) -> Any:
        """The model's forward, recorded; then check that only the root stays gathered."""
        self.active = True
        try:
            out = self.model(*args)
        finally:
            self.active = False
        if self.model.sharding_strategy.name == "FULL_SHARD":
            assert self.gathered() == [], self.gathered()
        return out


def _name(model: nn.Module, fsdp_module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is fsdp_module:
            return name.replace("_fsdp_wrapped_module.", "")
    raise AssertionError("not in the model")


def _wrap(net: nn.Module, strategy: str, **kwargs: Any) -> Any:
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    return fsdp.FullyShardedDataParallel(
        net,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=fsdp.ShardingStrategy[strategy],
        device_id=torch.device("cpu"),
        **kwargs,
    )


# ----------------------------------------------------------------- order of issue and compute

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "forward_prefetch": {"forward_prefetch": True, "limit_all_gathers": False},
    "on_demand": {"limit_all_gathers": False},
}


def _recorded_step(
    rec: Recorder, opt: torch.optim.Optimizer, x: Tensor, y: Tensor
) -> tuple[list[str], float]:
    """One training step: the events its forward recorded, and its loss."""
    rec.events = []
    loss = loss_fn(rec.forward(x), y)
    events = rec.events
    loss.backward()
    opt.step()
    opt.zero_grad()
    return events, loss.item()


def _rank_order() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, kwargs in CONFIGS.items():
        model = _wrap(make_net(n_blocks=N_BLOCKS), "FULL_SHARD", **kwargs)
        model._fsdp_state.lazy_init()
        rec = Recorder(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        per_iter, losses = [], []
        with rec.spying():
            for x, y in batches(3):
                events, loss = _recorded_step(rec, opt, x, y)
                per_iter.append(events)
                losses.append(loss)
        out[name] = {"events": per_iter, "losses": losses, "max_gathered": rec.max_gathered}
    return out


def _expected(ahead: bool) -> list[str]:
    units = ["root"] + [f"blocks.{i}" for i in range(N_BLOCKS)]
    if not ahead:
        return [e for u in units for e in (f"issue {u}", f"compute {u}")]
    events = ["issue root", "issue blocks.0", "compute root"]
    for i in range(N_BLOCKS):
        if i + 1 < N_BLOCKS:
            events.append(f"issue blocks.{i + 1}")
        events.append(f"compute blocks.{i}")
    return events


@pytest.mark.parametrize("world_size", [2, 4])
def test_next_gather_issued_before_current_computes(world_size: int) -> None:
    ranks = run_ranks(_rank_order, world_size, timeout=120)
    for r in ranks:
        for name in CONFIGS:  # the same all-gathers in the same order on every rank
            assert r[name]["events"] == ranks[0][name]["events"], name
        for name, ahead in (("default", True), ("forward_prefetch", True), ("on_demand", False)):
            first, *later = r[name]["events"]
            assert first == _expected(False), (name, first)  # no order recorded yet
            for events in later:
                assert events == _expected(ahead), (name, events)
            # One unit ahead of the one computing, never more (the rate limit's two units).
            assert r[name]["max_gathered"] == (2 if ahead else 1), (name, r[name])
        # Issuing earlier changes no number.
        assert r["default"]["losses"] == r["on_demand"]["losses"]


# ----------------------------------------------------------------- an order that changes


class BranchNet(nn.Module):
    """Blocks a and b always; block c between them only while ``detour`` is set."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(13, 6)
        self.a, self.b, self.c = Block(), Block(), Block()
        self.head = nn.Linear(6, 13)
        self.detour = False

    def forward(self, idx: Tensor) -> Tensor:
        h = self.a(self.emb(idx))
        if self.detour:
            h = self.c(h)
        return self.head(self.b(h))


# The same on every rank: the branch depends on the iteration, not on the data.
DETOURS = [False, False, True, True, False, True, False, False]


def _set_detour(model: nn.Module, on: bool) -> None:
    for m in model.modules():
        if isinstance(m, BranchNet):
            m.detour = on


def _rank_branch(strategy: str) -> dict[str, Any]:
    data = batches(len(DETOURS))
    ref = BranchNet()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    model = _wrap(BranchNet(), strategy)
    model._fsdp_state.lazy_init()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rec = Recorder(model)
    per_iter, losses, ref_losses = [], [], []
    with rec.spying():
        for detour, (x, y) in zip(DETOURS, data, strict=True):
            _set_detour(ref, detour)
            ref_loss = F.cross_entropy(ref(x).reshape(-1, 13), y.reshape(-1))
            ref_loss.backward()
            average_grads(ref)
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(ref_loss.item())
            _set_detour(model, detour)
            events, loss = _recorded_step(rec, opt, x, y)
            per_iter.append(events)
            losses.append(loss)
    # Evaluation without gradients, the branch on, then off: not recorded, same outputs.
    eval_diffs = []
    with torch.no_grad():
        for detour in (True, False, True):
            _set_detour(ref, detour)
            _set_detour(model, detour)
            x = data[0][0]
            rec.events = []
            eval_diffs.append((rec.forward(x) - ref(x)).abs().max().item())
            assert rec.gathered() == [], rec.gathered()  # nothing left gathered, either strategy
    return {
        "eval_diffs": eval_diffs,
        "eval_order": len(model._fsdp_state.ctx.exec_order.forward_order),
        "events": per_iter,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_diff": max_diff(full_params(model), full_params(ref)),
        "max_gathered": rec.max_gathered,
        "changes": model._fsdp_state.ctx.exec_order.changes,
    }


def _ahead(units: list[str]) -> list[str]:
    events = [f"issue {units[0]}", f"issue {units[1]}", f"compute {units[0]}"]
    for i in range(1, len(units)):
        if i + 1 < len(units):
            events.append(f"issue {units[i + 1]}")
        events.append(f"compute {units[i]}")
    return events


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_order_change_falls_back(world_size: int, strategy: str) -> None:
    ranks = run_ranks(_rank_branch, world_size, strategy, timeout=120)
    for r in ranks:
        assert r["events"] == ranks[0]["events"]  # the same all-gathers in the same order
        if world_size == 2:  # every sum in the same order as the reference's
            assert r["losses"] == r["ref_losses"], r
            assert r["param_diff"] == 0.0, r
        else:
            assert (
                max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"], strict=True)) < 1e-5
            ), r
            assert r["param_diff"] < 1e-5, r
        # FULL_SHARD: the unit computing and one ahead. SHARD_GRAD_OP keeps the units that
        # ran gathered until their backward anyway: issuing ahead adds at most one more.
        assert r["max_gathered"] == (2 if strategy == "FULL_SHARD" else 3), r
        assert r["changes"] == 4, r  # iterations 2, 4, 5 and 6 switch the branch
        assert max(r["eval_diffs"]) <= (0.0 if world_size == 2 else 1e-5), r
        assert r["eval_order"] == 3, r  # the last training forward's, not evaluation's
    events = ranks[0]["events"]
    short, long = ["root", "a", "b"], ["root", "a", "c", "b"]
    if strategy == "FULL_SHARD":
        assert events[1] == _ahead(short)
        # The detour appears: b (recorded next) was issued ahead; c gathers on demand.
        assert events[2] == [
            "issue root", "issue a", "compute root", "issue b", "compute a",
            "issue c", "compute c", "compute b",
        ]  # fmt: skip
        assert events[3] == _ahead(long)  # the new order, issued ahead again
        # The detour disappears: c, issued ahead, is not used (freed after the forward).
        assert events[4] == [
            "issue root", "issue a", "compute root", "issue c", "compute a",
            "issue b", "compute b",
        ]  # fmt: skip
        assert events[7] == _ahead(short)
