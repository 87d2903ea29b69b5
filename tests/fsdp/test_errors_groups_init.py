"""Error paths of hybrid sharding, device meshes, deferred init, ignored and shared states.

Every case runs on 4 ranks (so that 2x2 meshes exist) and returns the
exception it raised, type and message, for the test to match: each message
names the problem and the fix.
"""

from __future__ import annotations

import os
import re
import traceback
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
from fsdp import ShardingStrategy
from tests.fsdp._common import make_net
from tests.ranks import run_ranks

HYBRID = ShardingStrategy.HYBRID_SHARD
CASES: dict[str, Callable[[], object]] = {}


def case(fn: Callable[[], object]) -> Callable[[], object]:
    CASES[fn.__name__] = fn
    return fn


def _mesh_2d() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


# ----------------------------------------------------------------- process groups


@case
def group_and_mesh() -> object:
    return FSDP(nn.Linear(2, 2), process_group=dist.group.WORLD, device_mesh=_mesh_2d())


@case
def pair_without_hybrid() -> object:
    mesh = _mesh_2d()
    return FSDP(nn.Linear(2, 2), process_group=(mesh.get_group(1), mesh.get_group(0)))


@case
def single_group_with_hybrid() -> object:
    return FSDP(nn.Linear(2, 2), sharding_strategy=HYBRID, process_group=dist.group.WORLD)


@case
def pair_of_non_groups() -> object:
    return FSDP(nn.Linear(2, 2), sharding_strategy=HYBRID, process_group=(1, 2))


@case
def pair_not_covering_world() -> object:
    world = dist.group.WORLD
    return FSDP(nn.Linear(2, 2), sharding_strategy=HYBRID, process_group=(world, world))


@case
def mesh_1d_with_hybrid() -> object:
    mesh = init_device_mesh("cpu", (4,))
    return FSDP(nn.Linear(2, 2), sharding_strategy=HYBRID, device_mesh=mesh)


@case
def mesh_2d_without_hybrid() -> object:
    return FSDP(nn.Linear(2, 2), device_mesh=_mesh_2d())


@case
def mesh_not_a_mesh() -> object:
    return FSDP(nn.Linear(2, 2), device_mesh=dist.group.WORLD)


@case
def not_in_mesh() -> object:
    mesh = DeviceMesh("cpu", [0, 1])  # every rank builds it; ranks 2 and 3 are outside
    if dist.get_rank() < 2:
        raise RuntimeError("member: skipped")  # only the outsiders wrap
    return FSDP(nn.Linear(2, 2), device_mesh=mesh)


def _with_local_world_size(value: str | None) -> object:
    old = os.environ.pop("LOCAL_WORLD_SIZE", None)
    if value is not None:
        os.environ["LOCAL_WORLD_SIZE"] = value
    try:
        return FSDP(nn.Linear(2, 2), sharding_strategy=HYBRID)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if old is not None:
            os.environ["LOCAL_WORLD_SIZE"] = old


@case
def no_local_world_size() -> object:
    return _with_local_world_size(None)


@case
def uneven_local_world_size() -> object:
    return _with_local_world_size("3")


@case
def bad_local_world_size() -> object:
    return _with_local_world_size("two")


@case
def comm_hook_with_hybrid() -> object:
    from torch.distributed.algorithms._comm_hooks import default_hooks

    model = FSDP(nn.Linear(2, 2), sharding_strategy=HYBRID, device_mesh=_mesh_2d())
    model.register_comm_hook(
        default_hooks.DefaultState(dist.group.WORLD), default_hooks.reduce_scatter_hook
    )
    return model


# ----------------------------------------------------------------- deferred initialisation


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _NoReset()
        self.lin = nn.Linear(3, 3)


@case
def meta_without_reset_parameters() -> object:
    with torch.device("meta"):
        net = _Outer()
    return FSDP(net)


@case
def param_init_fn_not_callable() -> object:
    return FSDP(nn.Linear(2, 2), param_init_fn=3)  # type: ignore[arg-type]


@case
def param_init_fn_leaves_meta() -> object:
    with torch.device("meta"):
        net = _Outer()
    return FSDP(net, param_init_fn=lambda m: None)


# ----------------------------------------------------------------- ignored states


@case
def both_ignored_arguments() -> object:
    net = make_net()
    return FSDP(net, ignored_modules=[net.head], ignored_states=[net.head])


@case
def ignored_states_mixed() -> object:
    net = make_net()
    return FSDP(net, ignored_states=[net.head, net.emb.weight])


@case
def ignored_fsdp_instance() -> object:
    net = make_net()
    net.blocks[0] = FSDP(net.blocks[0])
    return FSDP(net, ignored_modules=[net.blocks[0]])


@case
def ignored_single_module() -> object:
    net = make_net()
    return FSDP(net, ignored_modules=net.head)


@case
def ignored_not_modules() -> object:
    return FSDP(make_net(), ignored_modules=[3])  # type: ignore[list-item]


@case
def ignored_root_warns() -> object:
    net = make_net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return FSDP(net, ignored_modules=[net])


# ----------------------------------------------------------------- shared parameters


@case
def shared_between_manual_siblings() -> object:
    net = make_net()
    net.blocks[1].fc1.weight = net.blocks[0].fc1.weight
    net.blocks[0] = FSDP(net.blocks[0])
    return FSDP(net.blocks[1])


EXPECTED: dict[str, tuple[str, str]] = {
    "group_and_mesh": ("ValueError", "either process_group= or device_mesh=.*not both"),
    "pair_without_hybrid": (
        "ValueError",
        r"pair is only for hybrid sharding, but sharding_strategy=FULL_SHARD; pass "
        r"sharding_strategy=ShardingStrategy\.HYBRID_SHARD",
    ),
    "single_group_with_hybrid": (
        "ValueError",
        r"HYBRID_SHARD needs two groups.*pass process_group=\(shard_group, replicate_group\)",
    ),
    "pair_of_non_groups": ("TypeError", r"pair \(shard_group, replicate_group\).*\['int', 'int'\]"),
    "pair_not_covering_world": (
        "ValueError",
        r"shard\(4\) \* replicate\(4\) != WORLD_SIZE\(4\)",
    ),
    "mesh_1d_with_hybrid": (
        "ValueError",
        r"needs a 2-D device_mesh with dimensions \(replicate, shard\), got a 1-D mesh",
    ),
    "mesh_2d_without_hybrid": (
        "ValueError",
        r"FULL_SHARD shards over one group, so device_mesh must be 1-D, got a 2-D mesh of "
        r"shape \(2, 2\).*HYBRID_SHARD",
    ),
    "mesh_not_a_mesh": ("TypeError", "device_mesh must be a .*DeviceMesh, got ProcessGroup"),
    "not_in_mesh": ("ValueError", "not part of the device_mesh"),
    "no_local_world_size": (
        "ValueError",
        "LOCAL_WORLD_SIZE environment variable.*not set.*device_mesh=init_device_mesh",
    ),
    "uneven_local_world_size": ("ValueError", r"WORLD_SIZE\(4\) % LOCAL_WORLD_SIZE\(3\) != 0"),
    "bad_local_world_size": ("ValueError", "LOCAL_WORLD_SIZE must be an integer, got 'two'"),
    "comm_hook_with_hybrid": (
        "_CommHookError",  # a RuntimeError and, as torch's, an AssertionError
        "^Communication hook is not supported for hybrid strategies: "
        "ShardingStrategy.HYBRID_SHARD .*only the reduce-scatter",
    ),
    "meta_without_reset_parameters": (
        "ValueError",
        r"module 'inner' \(_NoReset\) has parameters or buffers on the meta device but no "
        r"reset_parameters\(\).*or pass param_init_fn=",
    ),
    "param_init_fn_not_callable": (
        "ValueError",
        "^Expected 3 to be callable but got <class 'int'>: param_init_fn must be a callable",
    ),
    "param_init_fn_leaves_meta": (
        "ValueError",
        r"\"'inner' \(_NoReset\)\.weight\".*still on the meta device: param_init_fn did not "
        r"materialise them",
    ),
    "both_ignored_arguments": (
        "ValueError",
        "^Cannot pass both ignored_modules and ignored_states at the same time: pass one",
    ),
    "ignored_states_mixed": (  # torch's words and type (ValueError); ours, a TypeError
        "_NotModulesError",
        r"^ignored_states expects all nn\.Parameter or all nn\.Module list elements but got "
        r"types \[<class 'torch\.nn\.modules\.linear\.Linear'>, "
        r"<class 'torch\.nn\.parameter\.Parameter'>\]; pass the modules' parameters",
    ),
    "ignored_fsdp_instance": (
        "ValueError",
        "^`ignored_modules` should not include FSDP modules: .*manages its own parameters",
    ),
    "ignored_single_module": ("TypeError", r"got a single Linear; wrap it in a list"),
    "ignored_not_modules": (
        "_NotModulesError",
        r"^ignored_modules expects nn\.Module list elements but got types \[<class 'int'>\]",
    ),
    "ignored_root_warns": (
        "UserWarning",
        "^Trying to ignore the top-level module passed into the FSDP constructor itself will "
        "result in all parameters being ignored.*Net is itself in ignored_modules",
    ),
    "shared_between_manual_siblings": (
        "SharedParameterError",
        r"parameter 'fc1\.weight' \(Linear\) is the same tensor as 'fc1\.weight', which "
        r"another FSDP unit \(wrapping a Block\) already flattened.*built \(by hand\) "
        "before the one holding this use.*auto_wrap_policy",
    ),
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
    for rank, out in enumerate(run_ranks(_rank_errors, 4, timeout=120)):
        for name, expected in EXPECTED.items():
            got_type, message = out[name]
            if name == "not_in_mesh" and rank < 2:
                expected = ("RuntimeError", "member: skipped")  # noqa: PLW2901 (members)
            etype, pattern = expected
            assert got_type == etype, (rank, name, got_type, message)
            assert re.search(pattern, message, re.DOTALL), (rank, name, pattern, message)
