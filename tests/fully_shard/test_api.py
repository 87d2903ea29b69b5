"""fully_shard's contract as torch 2.13 documents it, checked on our implementation.

Each rank function runs several sub-cases in one spawn and returns what it saw;
the assertions are in the test process. References: the unsharded model (the
same seed on every rank), torch's own fully_shard where behaviour is compared,
or the documented behaviour itself (registered parameter types, error types).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.fsdp._common import batches, loss_fn
from tests.fully_shard._common import TinyNet, full
from tests.ranks import run_ranks


def _sharded() -> tuple[nn.Module, Any]:
    import fsdp

    torch.manual_seed(0)
    model = TinyNet()
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    return model, fsdp


def _collective_counter() -> tuple[list[str], Any]:
    """Count every collective issued (patches torch.distributed in this rank)."""
    calls: list[str] = []
    names = [
        "all_gather_single",
        "all_gather_into_tensor",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_reduce",
        "broadcast",
        "all_to_all_single",
        "all_gather",
        "all_gather_object",
    ]
    saved = {n: getattr(dist, n) for n in names}

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return saved[name](*args, **kwargs)

        return call

    for n in names:
        setattr(dist, n, spy(n))

    def restore() -> None:
        for n, f in saved.items():
            setattr(dist, n, f)

    return calls, restore


def _types_and_state_rank() -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    out: dict[str, Any] = {}
    model, fsdp = _sharded()
    out["isinstance"] = (
        isinstance(model, fsdp.FSDPModule),
        isinstance(model, TinyNet),
        type(model).__name__,
        all(isinstance(b, fsdp.FSDPModule) for b in model.blocks),
        isinstance(model.head, fsdp.FSDPModule),
    )
    out["params"] = {
        n: (type(p).__name__, str(p.placements), tuple(p.to_local().shape))
        for n, p in model.named_parameters()
    }
    torch.manual_seed(0)
    ref = TinyNet()
    out["full_equal"] = all(
        torch.equal(p.full_tensor(), r)
        for p, r in zip(model.parameters(), ref.parameters(), strict=True)
    )
    calls, restore = _collective_counter()
    try:
        sd = model.state_dict()
    finally:
        restore()
    out["state_dict_collectives"] = list(calls)
    out["state_dict"] = sorted((k, type(v).__name__) for k, v in sd.items())
    out["ref_keys"] = sorted(ref.state_dict().keys())
    # Load a second model's sharded state dict, and full tensors through distribute_tensor.
    torch.manual_seed(1)
    other = TinyNet()
    for block in other.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(other)
    other.load_state_dict(model.state_dict())
    out["load_sharded"] = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )
    torch.manual_seed(2)
    third = TinyNet()
    for block in third.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(third)
    mesh = third.head.weight.device_mesh
    sharded_keys = {k for k, v in third.state_dict().items() if isinstance(v, DTensor)}
    fulls = {
        k: distribute_tensor(v, mesh, [Shard(0)]) if k in sharded_keys else v
        for k, v in ref.state_dict().items()
    }
    third.load_state_dict(fulls)
    out["load_full"] = all(
        torch.equal(a.full_tensor(), b)
        for a, b in zip(third.parameters(), ref.parameters(), strict=True)
    )
    # assign=True replaces the parameter objects: training must still gather the right values.
    fourth = TinyNet()
    for block in fourth.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(fourth)
    fourth.load_state_dict(model.state_dict(), assign=True)
    x, _ = batches(1)[0]
    with torch.no_grad():
        out["assign_forward"] = torch.equal(fourth(x), ref(x))
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_types_parameters_and_state_dict(world_size: int) -> None:
    results = run_ranks(_types_and_state_rank, world_size)
    for rank, r in enumerate(results):
        assert r["isinstance"] == (True, True, "FSDPTinyNet", True, False)
        for name, (kind, placements, _) in r["params"].items():
            assert (kind, placements) == ("DTensor", "(Shard(dim=0),)"), name
        assert r["full_equal"]
        assert r["state_dict_collectives"] == [], "state_dict() must not communicate"
        assert [k for k, _ in r["state_dict"]] == r["ref_keys"]
        assert {t for k, t in r["state_dict"] if k != "scale"} == {"DTensor"}
        assert r["load_sharded"] and r["load_full"] and r["assign_forward"], rank
    if world_size == 2:
        # gate (1, 6): rank 1 holds an empty chunk; head.weight (13, 6): 7 and 6 rows.
        assert results[1]["params"]["gate"][2] == (0, 6)
        assert results[0]["params"]["head.weight"][2] == (7, 6)
        assert results[1]["params"]["head.weight"][2] == (6, 6)


def _registration_rank() -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    import fsdp

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    model = TinyNet()
    for block in model.blocks:
        fsdp.fully_shard(block)  # default: reshard after forward (not the root)
    fsdp.fully_shard(model)
    x, y = batches(1)[0]
    loss = loss_fn(model(x), y)
    out["after_forward"] = (
        isinstance(model.blocks[0].fc1.weight, DTensor),  # resharded
        isinstance(model.head.weight, DTensor),  # root keeps them for backward
    )
    loss.backward()
    out["after_backward"] = all(isinstance(p, DTensor) for p in model.parameters())
    out["grads"] = all(
        isinstance(p.grad, DTensor) and p.grad.placements == p.placements
        for p in model.parameters()
    )
    # unshard / reshard by hand, and the async handle
    model.blocks[1].unshard()
    w = model.blocks[1].fc1.weight
    out["unshard"] = (type(w).__name__, tuple(w.shape))
    model.blocks[1].reshard()
    out["reshard"] = isinstance(model.blocks[1].fc1.weight, DTensor)
    handle = model.blocks[2].unshard(async_op=True)
    assert handle is not None
    handle.wait()
    out["async"] = tuple(model.blocks[2].fc2.weight.shape)
    model.blocks[2].reshard()
    # forward called directly on sharded parameters: refused; registered: works
    try:
        model.blocks[0].forward(torch.randn(2, 5, 6))
        out["direct_forward"] = "ran"
    except RuntimeError as e:
        out["direct_forward"] = str(e)
    h = torch.randn(2, 5, 6)
    expected = model.blocks[0](h)
    fsdp.register_fsdp_forward_method(model.blocks[0], "forward")
    out["registered_forward"] = torch.equal(model.blocks[0].forward(h), expected)
    out["register_noop_plain"] = fsdp.register_fsdp_forward_method(nn.Linear(2, 2), "forward")
    # copy.deepcopy is refused as torch's (use the state dict)
    try:
        copy.deepcopy(model)
        out["deepcopy"] = "copied"
    except AssertionError as e:
        out["deepcopy"] = str(e)
    # a container slice is a plain container, not an FSDP module
    out["slice"] = type(nn.Sequential(model.blocks[0], model.blocks[1])[0:1]).__name__
    return out


def test_registered_parameters_follow_the_group_state() -> None:
    for r in run_ranks(_registration_rank, 2):
        assert r["after_forward"] == (True, False)
        assert r["after_backward"] and r["grads"]
        assert r["unshard"] == ("Parameter", (13, 6))
        assert r["reshard"]
        assert r["async"] == (6, 13)
        assert "called directly" in r["direct_forward"]
        assert "register_fsdp_forward_method" in r["direct_forward"]
        assert r["registered_forward"]
        assert r["register_noop_plain"] is None
        assert "deepcopy" in r["deepcopy"]
        assert r["slice"] == "Sequential"


def _errors_rank() -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp

    out: dict[str, str] = {}

    def catch(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "no error"
        except Exception as e:
            # Our argument errors are ValueErrors and (as torch's) AssertionErrors.
            both = isinstance(e, ValueError) and isinstance(e, AssertionError)
            out[name] = f"{'ValueError+AssertionError' if both else type(e).__name__}: {e}"

    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.tensor(1.0))

    catch("scalar", lambda: fsdp.fully_shard(Scalar()))
    catch("container", lambda: fsdp.fully_shard(nn.ModuleList([nn.Linear(2, 2)])))
    catch("empty_list", lambda: fsdp.fully_shard([]))
    pair = [nn.Linear(2, 2), nn.Linear(2, 2)]
    fsdp.fully_shard(pair)  # several modules as one group: fine, but not as the root
    catch("list_as_root", lambda: pair[0](torch.randn(1, 2)))
    twice = nn.Linear(2, 2)
    fsdp.fully_shard(twice)
    catch("twice", lambda: fsdp.fully_shard(twice))
    catch("bad_mesh", lambda: fsdp.fully_shard(nn.Linear(2, 2), mesh="cpu"))
    catch(
        "mesh_3d",
        lambda: fsdp.fully_shard(
            nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, 1, dist.get_world_size()))
        ),
    )
    catch("reshard_int", lambda: fsdp.fully_shard(nn.Linear(4, 4), reshard_after_forward=3))
    catch("mp_type", lambda: fsdp.fully_shard(nn.Linear(4, 4), mp_policy=torch.bfloat16))  # type: ignore[arg-type]
    catch("dp_mesh_dims", lambda: fsdp.fully_shard(nn.Linear(4, 4), dp_mesh_dims=object()))
    lin = fsdp.fully_shard(nn.Linear(4, 4))
    catch("custom_all_gather", lambda: lin.set_custom_all_gather(None))
    catch("symm_mem", lin.set_symm_mem_for_comm)
    catch("max_buffers", lambda: lin.set_reduce_scatter_max_input_buffers(0))
    catch("raf_type", lambda: lin.set_reshard_after_forward(2))  # type: ignore[arg-type]
    catch("prefetch_type", lambda: lin.set_modules_to_forward_prefetch([nn.Linear(2, 2)]))  # type: ignore[list-item]
    # inner forward first, then the outer one: torch's message
    torch.manual_seed(0)
    model = TinyNet()
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    model.blocks[0](torch.randn(1, 5, 6))
    catch("inner_first", lambda: model(torch.zeros(1, 5, dtype=torch.long)))
    # meta parameters never materialised
    with torch.device("meta"):
        meta = TinyNet()
    fsdp.fully_shard(meta)
    catch("meta", lambda: meta(torch.zeros(1, 5, dtype=torch.long)))
    # a parameter tied across two sibling calls that no enclosing call takes
    torch.manual_seed(0)
    tied = TinyNet()
    tied.blocks[1].fc1.weight = tied.blocks[0].fc1.weight
    fsdp.fully_shard(tied.blocks[0])
    fsdp.fully_shard(tied.blocks[1])
    catch("orphan_tie", lambda: tied.blocks[1](torch.randn(1, 5, 6)))
    return out


def test_errors_name_the_problem_and_the_fix() -> None:
    out = run_ranks(_errors_rank, 2)[0]
    assert out["scalar"].startswith("ValueError: fully_shard doesn't support scalar parameters")
    assert out["container"].startswith(
        "ValueError: fully_shard does not support containers that do not implement forward"
    )
    assert out["empty_list"].startswith("TypeError") and "non-empty list" in out["empty_list"]
    assert out["list_as_root"].startswith(
        "RuntimeError: FSDP requires a single root module but got"
    )
    assert "fully_shard(model)" in out["list_as_root"]
    assert out["twice"].startswith(
        "ValueError+AssertionError: Each distinct composable distributed API can only be applied"
    )
    assert "already applied" in out["twice"]
    assert out["bad_mesh"].startswith("TypeError") and "init_device_mesh" in out["bad_mesh"]
    assert out["mesh_3d"].startswith("ValueError: fully_shard expects a 1D or 2D DeviceMesh")
    assert out["reshard_int"].startswith("ValueError") and "factor of 2" in out["reshard_int"]
    assert out["mp_type"].startswith("TypeError") and "MixedPrecisionPolicy" in out["mp_type"]
    assert out["dp_mesh_dims"].startswith("ValueError: At least one of shard or replicate")
    assert out["custom_all_gather"].startswith("NotImplementedError: FSDPModule.set_custom")
    assert out["symm_mem"].startswith("NotImplementedError")
    assert out["max_buffers"].startswith("ValueError")
    assert out["raf_type"].startswith("ValueError: reshard_after_forward should be a bool")
    assert out["prefetch_type"].startswith("ValueError: Expects FSDPModule")
    assert "has already been lazily initialized for blocks.0" in out["inner_first"]
    assert out["meta"].startswith("RuntimeError: FSDP parameters should be materialized")
    assert "to_empty" in out["meta"]
    assert out["orphan_tie"].startswith("ValueError: parameter 'fc1.weight'")
    assert "no fully_shard call contains them all" in out["orphan_tie"]


def _tied_rank(layout: str) -> dict[str, Any]:
    """A weight tied across two fully_shard calls against the same model under DDP-style
    averaging by hand (torch's fully_shard refuses this: 'shared with a parameter already
    managed by another FSDP group')."""
    import fsdp
    from tests.fsdp._common import average_grads

    def make() -> TinyNet:
        torch.manual_seed(0)
        m = TinyNet()
        if layout == "siblings":
            m.blocks[2].fc1.weight = m.blocks[0].fc1.weight
        else:  # the head tied to a block sharded on its own: (13, 6) needs the same shape
            m.head.weight = nn.Parameter(torch.randn(13, 6))
            m.blocks[0].fc1 = nn.Linear(6, 13)
            m.blocks[0].fc1.weight = m.head.weight
        return m

    ref = make()
    model = make()
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    data = batches(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    worst = 0.0
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        average_grads(ref)
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()))
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        worst = max(worst, (full(p) - r).abs().max().item())
    return {"worst": worst}


@pytest.mark.parametrize("layout", ["siblings", "nested"])
def test_tied_parameters_across_calls_train_like_ddp(layout: str) -> None:
    for r in run_ranks(_tied_rank, 2, layout):
        assert r["worst"] <= 1e-6, r


def _frozen_memory_rank() -> dict[str, Any]:
    """Frozen parameters: no gradient, no bytes in the reduction; at most two groups gathered."""
    import fsdp

    torch.manual_seed(0)
    model = TinyNet()
    model.emb.requires_grad_(False)
    for block in model.blocks:
        block.ln.requires_grad_(False)
        block.fc1.requires_grad_(False)
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    from fsdp._fully_shard._state import state_of

    groups = [state_of(b).group for b in model.blocks]  # type: ignore[union-attr]
    gathered: list[int] = []

    def sample(*_: Any) -> None:
        gathered.append(sum(1 for g in groups if g is not None and g.unsharded_bytes() > 0))

    for b in model.blocks:
        b.fc2.register_forward_pre_hook(sample)
        b.fc2.register_full_backward_pre_hook(sample)
    x, y = batches(1)[0]
    loss_fn(model(x), y).backward()
    grads = {n: p.grad is not None for n, p in model.named_parameters()}
    trainable_local = sum(p.to_local().numel() for p in model.parameters() if p.requires_grad)
    grad_local = sum(p.grad.to_local().numel() for p in model.parameters() if p.grad is not None)
    reduce_numel = [
        part.storage.padded_numel for g in groups if g for part in g.parts if part.trainable
    ]
    trainable_numel = [
        sum(p.sharded.numel() for p in part.params)
        for g in groups
        if g
        for part in g.parts
        if part.trainable
    ]
    return {
        "grads": grads,
        "bytes": (trainable_local, grad_local),
        "reduce": list(zip(reduce_numel, trainable_numel, strict=True)),
        "gathered": max(gathered),
    }


def test_frozen_parameters_cost_no_gradient_bytes_and_two_groups_at_most() -> None:
    for r in run_ranks(_frozen_memory_rank, 2):
        for name, has in r["grads"].items():
            frozen = name.startswith("emb") or ".ln." in name or ".fc1." in name
            assert has is not frozen, name
        assert r["bytes"][0] == r["bytes"][1]
        for padded, numel in r["reduce"]:
            assert padded - numel < 2 * 8, (padded, numel)  # padding only, no frozen elements
        assert r["gathered"] <= 2


def _settings_rank() -> dict[str, Any]:
    """set_* methods against the documented effect, compared with a default run."""
    import fsdp

    out: dict[str, Any] = {}

    def run(configure: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = TinyNet()
        for block in model.blocks:
            fsdp.fully_shard(block)
        fsdp.fully_shard(model)
        configure(model)
        x, y = batches(1)[0]
        loss_fn(model(x), y).backward()
        return [full(p.grad) for p in model.parameters()]

    base = run(lambda m: None)
    doubled = run(lambda m: [b.set_all_reduce_hook(lambda g: g.mul_(2)) for b in [m, *m.blocks]])
    out["hook"] = all(torch.allclose(d, 2 * b) for d, b in zip(doubled, base, strict=True))
    halved = run(
        lambda m: [
            b.set_gradient_divide_factor(2.0 * dist.get_world_size()) for b in [m, *m.blocks]
        ]
    )
    out["divide"] = all(torch.allclose(h, b / 2) for h, b in zip(halved, base, strict=True))
    prefetched = run(
        lambda m: (
            m.blocks[0].set_modules_to_forward_prefetch([m.blocks[1], m.blocks[2]]),
            m.blocks[2].set_modules_to_backward_prefetch([m.blocks[1], m.blocks[0]]),
        )
    )
    out["prefetch"] = all(torch.equal(a, b) for a, b in zip(prefetched, base, strict=True))
    no_reshard = run(lambda m: m.set_reshard_after_forward(False))
    out["no_reshard"] = all(torch.equal(a, b) for a, b in zip(no_reshard, base, strict=True))
    return out


def test_settings_change_what_they_document() -> None:
    for r in run_ranks(_settings_rank, 2):
        assert r == {"hook": True, "divide": True, "prefetch": True, "no_reshard": True}


def _reset_rank() -> dict[str, Any]:
    """An exception inside forward, then reset_iter_state: the next step equals a clean one."""
    import fsdp

    class BoomError(RuntimeError):
        pass

    def make() -> nn.Module:
        torch.manual_seed(0)
        model = TinyNet()
        for block in model.blocks:
            fsdp.fully_shard(block)
        fsdp.fully_shard(model)
        return model

    x, y = batches(1)[0]
    clean = make()
    loss_fn(clean(x), y).backward()
    failing = make()
    handle = failing.blocks[1].register_forward_hook(lambda *a: (_ for _ in ()).throw(BoomError()))
    with contextlib.suppress(BoomError):
        failing(x)
    handle.remove()
    try:
        failing.blocks[0].reset_iter_state()
        non_root = "accepted"
    except RuntimeError as e:
        non_root = str(e)
    failing.reset_iter_state()
    loss_fn(failing(x), y).backward()
    same = all(
        torch.equal(full(a.grad), full(b.grad))
        for a, b in zip(clean.parameters(), failing.parameters(), strict=True)
    )
    return {"same": same, "non_root": non_root}


def test_reset_iter_state_recovers_after_a_failed_forward() -> None:
    for r in run_ranks(_reset_rank, 2):
        assert r["same"]
        assert "root" in r["non_root"]
