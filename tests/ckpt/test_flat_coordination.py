"""A save and a load take a fixed number of collective rounds, whatever the tensors and
ranks ([Note: flat coordination] in ``ckpt/_format/chunk_table.py``; issue 39).

Counted with ``benchmarks/collective_rounds.py`` (every ``torch.distributed`` primitive
call, object collectives counted as the two they are) at 2 and 4 ranks, for models of
10 and 200 tensors with AdamW state under our ``fully_shard`` and our FSDP1: the counts
are the same for every size, and those of a repeated save are those of the first. A
save of an unchanged structure sends only fingerprints: the bytes a rank puts into the
collectives then do not grow with the tensors either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ckpt
from benchmarks.collective_rounds import counting
from tests.ranks import run_ranks

SIZES = (10, 200)  # tensors: Linear(4, 4) layers, weight and bias each


def _model(front: str, tensors: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(tensors // 2)]
    model: nn.Module = nn.Sequential(*layers)
    if front == "fully_shard":
        from fsdp import fully_shard

        fully_shard(model)
    else:
        from fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return model, optim


def _rank_rounds(root: str, front: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ckpt.save({"warm-up": torch.zeros(1)}, Path(root) / "warm-up")  # the group's first save
    for tensors in SIZES:
        model, optim = _model(front, tensors)
        state = {"model": model, "optim": optim, "step": 7}
        for op in ("first save", "save", "load"):
            path = Path(root) / f"{front}-{tensors}"
            dist.barrier()
            with counting() as rounds:
                if op == "load":
                    ckpt.load(state, path)
                else:
                    ckpt.save(state, path, overwrite=op == "save")
            out[f"{op}|{tensors}"] = (rounds.total, rounds.sent)
    return out


@pytest.mark.parametrize("front", ["fully_shard", "fsdp1"])
def test_rounds_do_not_grow_with_tensors_or_ranks(tmp_path: Path, front: str) -> None:
    counts = {
        world: run_ranks(_rank_rounds, world, str(tmp_path / str(world)), front, timeout=120)
        for world in (2, 4)
    }
    seen: dict[str, set[int]] = {}
    for world, ranks in counts.items():
        for rank, found in enumerate(ranks):
            for key, (total, _) in found.items():
                seen.setdefault(key.split("|")[0], set()).add(total)
            # An unchanged structure sends fingerprints: no more bytes for 20x the tensors.
            small, large = found[f"save|{SIZES[0]}"][1], found[f"save|{SIZES[-1]}"][1]
            assert large <= small + 64, (world, rank, small, large)
    # One count per operation: the same at 2 and 4 ranks, for 10 and 200 tensors, on
    # every rank (a first save plans, a repeated one reuses the plan in as many rounds).
    assert seen == {"first save": {9}, "save": {9}, "load": {9}}, seen


def _sharded(group: Any) -> nn.Module:
    """A 64x64 weight under our ``fully_shard`` on ``group``'s ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    fully_shard(model, mesh=DeviceMesh.from_group(group, "cpu"))
    return model


def _rank_bytes_read(root: str, saved_on: int, loaded_on: int) -> dict[str, int] | None:
    """Save on the first ``saved_on`` ranks, load on the first ``loaded_on``: the bytes
    this rank's load read, and the tensor bytes it holds."""
    from ckpt._format import chunk_reader

    path = Path(root) / "c"
    save_group = dist.new_group(list(range(saved_on)))
    load_group = dist.new_group(list(range(loaded_on)))
    if dist.get_rank() < saved_on:
        ckpt.save({"model": _sharded(save_group)}, path, process_group=save_group)
    dist.barrier()
    if dist.get_rank() >= loaded_on:
        return None
    model = _sharded(load_group)
    read: list[int] = []
    real = chunk_reader._Files.read_into

    def counted(self: Any, name: str, at: int, buffer: memoryview) -> None:
        read.append(buffer.nbytes)
        real(self, name, at, buffer)

    chunk_reader._Files.read_into = counted  # type: ignore[method-assign]
    try:
        ckpt.load({"model": model}, path, process_group=load_group)
    finally:
        chunk_reader._Files.read_into = real  # type: ignore[method-assign]
    local = next(iter(model.parameters())).to_local()
    return {"read": sum(read), "holds": local.numel() * local.element_size()}


@pytest.mark.parametrize(("saved_on", "loaded_on"), [(2, 4), (4, 2)])
def test_a_load_reads_only_the_byte_ranges_it_needs(
    tmp_path: Path, saved_on: int, loaded_on: int
) -> None:
    """Saved at one world size, loaded at another: each rank reads the rows of the
    saved chunks that overlap its own shard, no more (the weight is 16 KiB; a rank
    holds 16 KiB / world)."""
    world = max(saved_on, loaded_on)
    out = run_ranks(_rank_bytes_read, world, str(tmp_path), saved_on, loaded_on, timeout=120)
    for found in out[:loaded_on]:
        assert found is not None
        assert found["read"] == found["holds"] == 64 * 64 * 4 // loaded_on, out
