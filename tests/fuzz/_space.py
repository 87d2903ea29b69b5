"""What the differential fuzzer draws: a model, a sharding plan, a schedule of knobs.

Every example is a frozen dataclass of plain values, so hypothesis can shrink it,
its ``repr`` is valid Python, and :func:`reproduction` turns it into a standalone
script. The space is small models (widths down to 1, below every world size),
tied, frozen and unused parameters, the ways either front end can be applied,
and per step the knobs that reorder gathers, frees and reductions, including
wrong prefetch lists and ``unshard`` / ``reshard`` by hand in odd places.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from hypothesis import strategies as st

Point = Literal["before_forward", "after_forward", "after_backward", "after_step"]
Op = Literal["unshard", "unshard_async", "unshard_nowait", "reshard", "summon"]

STEPS = 3
POINTS: tuple[Point, ...] = ("before_forward", "after_forward", "after_backward", "after_step")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """``FuzzNet``'s shape: embedding, blocks, final norm, head (see ``_model.py``)."""

    dim: int
    widths: tuple[int, ...]  # one hidden width per block
    tie_head: bool = False  # head.weight is emb.weight
    tie_blocks: bool = False  # blocks.1.fc1.weight is blocks.0.fc1.weight (equal widths)
    frozen: tuple[str, ...] = ()  # modules whose parameters are frozen
    unused: bool = False  # a Linear that no forward calls

    def unit_names(self) -> list[str]:
        """Modules a plan may shard or wrap on their own."""
        return ["emb", *(f"blocks.{i}" for i in range(len(self.widths))), "ln_f", "head"] + (
            ["unused"] if self.unused else []
        )


@dataclasses.dataclass(frozen=True)
class Micro:
    """One micro-batch of a step."""

    sync: bool = True  # reduce gradients on it (the last of a step always does)
    last_backward: bool | None = None  # set_is_last_backward(value) before it, if not None
    all_reduce: bool = True  # HSDP: set_requires_all_reduce (the last of a step: True)


@dataclasses.dataclass(frozen=True)
class Step:
    """One optimizer step: its micro-batches, settings changed first, calls by hand."""

    micros: tuple[Micro, ...] = (Micro(),)
    # (module name, setter, value): e.g. ("blocks.0", "set_reshard_after_backward", False);
    # a prefetch setter's value is a tuple of module names.
    settings: tuple[tuple[str, str, object], ...] = ()
    calls: tuple[tuple[Point, str, Op], ...] = ()  # (when, module name, what)


@dataclasses.dataclass(frozen=True)
class FullyShardPlan:
    """``fully_shard`` calls, inner first; the root (``""``) is always the last."""

    calls: tuple[tuple[str, ...], ...]  # each call's module names (several: one group)
    reshard_after_forward: tuple[bool | int | None, ...]  # one per call
    hsdp: bool = False  # a (2, world/2) mesh
    across: bool = False  # hsdp with shard_across_replicas=True
    offload: bool = False  # CPUOffloadPolicy on every call
    mp: str | None = None  # MixedPrecisionPolicy on every call: "bf16" or "bf16-fp32" (reduce)


@dataclasses.dataclass(frozen=True)
class Fsdp1Plan:
    """``FullyShardedDataParallel`` units (inner first, the root wraps the rest)."""

    wrap: tuple[str, ...]
    strategy: str = "FULL_SHARD"
    forward_prefetch: bool = False
    backward_prefetch: str | None = "BACKWARD_PRE"
    limit_all_gathers: bool = True
    use_orig_params: bool = False
    cpu_offload: bool = False


@dataclasses.dataclass(frozen=True)
class Example:
    """One fuzz example: run ``steps`` on ``world_size`` ranks against DDP."""

    world_size: int
    model: ModelSpec
    plan: FullyShardPlan | Fsdp1Plan
    steps: tuple[Step, ...]
    seed: int = 0


def reproduction(example: Example) -> str:
    """A standalone script that runs ``example`` (printed with a failing example)."""
    return (
        "# save as repro.py in the repository root; run: python repro.py\n"
        "from tests.fuzz._run import check_example\n"
        "from tests.fuzz._space import *  # noqa: F403\n\n"
        'if __name__ == "__main__":\n'
        f"    check_example({example!r})\n"
    )


# --- strategies -------------------------------------------------------------------------------


@st.composite
def models(draw: st.DrawFn) -> ModelSpec:
    dim = draw(st.integers(1, 6))
    widths = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    tie_blocks = len(widths) >= 2 and widths[0] == widths[1] and draw(st.booleans())
    if len(widths) >= 2 and not tie_blocks and draw(st.integers(0, 3)) == 0:
        widths = (widths[0], widths[0], *widths[2:])  # make a tie possible more often
        tie_blocks = True
    spec = ModelSpec(dim, widths, tie_head=draw(st.booleans()), tie_blocks=tie_blocks)
    names = [n for n in spec.unit_names() if n != "unused"]
    frozen = draw(st.lists(st.sampled_from(names), max_size=2, unique=True))
    return dataclasses.replace(spec, frozen=tuple(frozen), unused=draw(st.booleans()))


def _reshard_values(world_size: int, hsdp: bool) -> st.SearchStrategy[bool | int | None]:
    values: list[bool | int | None] = [True, False, None]
    if world_size == 4 and not hsdp:
        values.append(2)
    return st.sampled_from(values)


@st.composite
def fully_shard_plans(draw: st.DrawFn, model: ModelSpec, world_size: int) -> FullyShardPlan:
    hsdp = world_size == 4 and draw(st.booleans())
    units = model.unit_names()
    calls: list[tuple[str, ...]] = []
    i = 0
    while i < len(units):
        if draw(st.booleans()):
            size = draw(st.integers(1, 2)) if i + 1 < len(units) else 1
            calls.append(tuple(units[i : i + size]))
            i += size
        else:
            i += 1
    calls.append(("",))
    rafs = tuple(draw(_reshard_values(world_size, hsdp)) for _ in calls)
    mp = draw(st.sampled_from([None, None, "bf16", "bf16-fp32"]))
    across = hsdp and draw(st.booleans())
    return FullyShardPlan(
        tuple(calls), rafs, hsdp, across=across, offload=draw(st.booleans()), mp=mp
    )


@st.composite
def fsdp1_plans(draw: st.DrawFn, model: ModelSpec, world_size: int) -> Fsdp1Plan:
    units = [n for n in model.unit_names() if n.startswith("blocks.") or n == "head"]
    wrap = tuple(u for u in units if draw(st.booleans()))
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
    if world_size == 4:
        strategies += ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "HYBRID_SHARD_ACROSS_REPLICAS"]
    return Fsdp1Plan(
        wrap=wrap,
        strategy=draw(st.sampled_from(strategies)),
        forward_prefetch=draw(st.booleans()),
        backward_prefetch=draw(st.sampled_from([None, "BACKWARD_PRE", "BACKWARD_POST"])),
        limit_all_gathers=draw(st.booleans()),
        use_orig_params=draw(st.booleans()),
        cpu_offload=draw(st.booleans()),
    )


@st.composite
def _micros(draw: st.DrawFn, fully_shard: bool, hsdp: bool = False) -> tuple[Micro, ...]:
    n = draw(st.integers(1, 3))
    out = []
    for k in range(n):
        last = k == n - 1
        sync = True if last else draw(st.booleans())
        flag = draw(st.sampled_from([None, True, False])) if fully_shard else None
        all_reduce = True if last or not hsdp else draw(st.booleans())
        out.append(Micro(sync=sync, last_backward=flag, all_reduce=all_reduce))
    return tuple(out)


@st.composite
def _fully_shard_settings(
    draw: st.DrawFn, names: list[str], world_size: int, hsdp: bool
) -> tuple[tuple[str, str, object], ...]:
    out: list[tuple[str, str, object]] = []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(names))
        # set_unshard_in_backward(False) is right only for a module whose backward reads
        # no parameters (the embedding) and raises elsewhere: drawn less often.
        setter = draw(
            st.sampled_from(
                [
                    "set_reshard_after_forward",
                    "set_reshard_after_forward",
                    "set_reshard_after_backward",
                    "set_reshard_after_backward",
                    "set_modules_to_forward_prefetch",
                    "set_modules_to_forward_prefetch",
                    "set_modules_to_backward_prefetch",
                    "set_modules_to_backward_prefetch",
                    "set_unshard_in_backward",
                ]
            )
        )
        if setter == "set_unshard_in_backward" and "emb" in names and draw(st.booleans()):
            name = "emb"
        value: object
        if setter == "set_reshard_after_forward":
            value = draw(_reshard_values(world_size, hsdp).filter(lambda v: v is not None))
        elif setter.startswith("set_modules_to"):
            value = tuple(draw(st.lists(st.sampled_from(names), max_size=2, unique=True)))
        else:
            value = draw(st.booleans())
        out.append((name, setter, value))
    return tuple(out)


@st.composite
def _calls(draw: st.DrawFn, names: list[str], ops: list[Op]) -> tuple[tuple[Point, str, Op], ...]:
    n = draw(st.integers(0, 2))
    return tuple(
        (draw(st.sampled_from(POINTS)), draw(st.sampled_from(names)), draw(st.sampled_from(ops)))
        for _ in range(n)
    )


@st.composite
def examples(draw: st.DrawFn, front_end: str, world_size: int) -> Example:
    """One example for ``front_end`` (``"fully_shard"`` or ``"fsdp1"``) at ``world_size``."""
    model = draw(models())
    plan: FullyShardPlan | Fsdp1Plan
    steps: list[Step] = []
    if front_end == "fully_shard":
        plan = draw(fully_shard_plans(model, world_size))
        # A call is named by its first module (the root: "").
        names = [c[0] for c in plan.calls]
        ops: list[Op] = ["unshard", "unshard_async", "unshard_nowait", "reshard"]
        for _ in range(STEPS):
            steps.append(
                Step(
                    micros=draw(_micros(True, plan.hsdp)),
                    settings=draw(_fully_shard_settings(names, world_size, plan.hsdp)),
                    calls=draw(_calls(names, ops)),
                )
            )
    else:
        plan = draw(fsdp1_plans(model, world_size))
        names = ["", *plan.wrap]
        for _ in range(STEPS):
            steps.append(Step(micros=draw(_micros(False)), calls=draw(_calls(names, ["summon"]))))
    return Example(world_size, model, plan, tuple(steps), seed=draw(st.integers(0, 2**16)))
