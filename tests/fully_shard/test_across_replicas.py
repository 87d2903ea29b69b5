"""``fully_shard(..., shard_across_replicas=True)`` on a 2x2 mesh against HSDP.

With two replicas the reduce-scatter across them adds the same two terms as HSDP's
all-reduce ([Note: sharding across replicas] in ``fsdp/_runtime/_replica_shard.py``),
so losses, every full gradient (before each AdamW step) and every full parameter
(after it) must equal torch's HSDP (``fully_shard`` on the same mesh) and ours bit
for bit; with clipping the norm sums over 4 shards instead of 2 (another order),
within 1e-5. Each rank's sharded parameters, gradients and so its optimizer state
are 1/4 of the model, on the mesh flattened. (Meta-device init is not compared: a
``DTensor`` random init draws each rank's local piece, which differs with the
layout, whatever the mode.)
"""

from __future__ import annotations

import dataclasses

import torch

from tests.fully_shard._common import Case, build, compare, train
from tests.fully_shard.test_parity import CASES as PARITY
from tests.ranks import run_ranks

# test_parity's cases that apply to a 2-D mesh (each run on one here; a few that add
# nothing here left out, for time), and more.
SKIPPED = ("meta_init", "accumulate_clip", "reshard_true_root_too", "ignored_params")
CASES: dict[str, Case] = {
    **{n: c for n, c in PARITY.items() if not c.mesh_2d and n not in SKIPPED},
    "reduce_scatter_only": Case(accumulate=2, all_reduce_only=True),
    "group_head": Case(group_head=True),
}
# Also against torch's HSDP (our HSDP equals it bit for bit: test_parity's hsdp cases).
WITH_TORCH = ("default", "bf16_reduce_fp32", "cpu_offload")


def _chunk(p: torch.Tensor, ranks: int) -> int:
    from torch.distributed.tensor import DTensor, Shard

    assert isinstance(p, DTensor) and isinstance(p.placements[0], Shard)
    dim = p.placements[0].dim
    return -(-p.shape[dim] // ranks) * (p.numel() // p.shape[dim])


def _rank(names: list[str]) -> dict[str, dict[str, object]]:
    from torch.distributed.tensor import DTensor

    out: dict[str, dict[str, object]] = {}
    for name in names:
        hsdp = dataclasses.replace(CASES[name], mesh_2d=True)
        across = dataclasses.replace(hsdp, across=True)
        ours_hsdp = train(build("ours", hsdp), hsdp)
        theirs = train(build("torch", hsdp), hsdp) if name in WITH_TORCH else ours_hsdp
        model = build("ours", across)
        ours = train(model, across)
        params = [p for p in model.parameters() if isinstance(p, DTensor)]
        out[name] = {
            "vs_torch": compare(theirs, ours),
            "vs_ours": compare(ours_hsdp, ours),
            "meshes": sorted({str(p.device_mesh.mesh.tolist()) for p in params}),
            "placements": sorted({str(p.placements) for p in params}),
            "local": sum(p.to_local().numel() for p in params),
            "total": sum(p.numel() for p in params),
            # FSDP's over 4 ranks: each parameter's padded torch.chunk of 4 (HSDP's: of 2)
            "chunk_of_4": sum(_chunk(p, 4) for p in params),
            "chunk_of_2": sum(_chunk(p, 2) for p in params),
        }
    return out


def test_fully_shard_across_replicas_equals_hsdp() -> None:
    results = run_ranks(_rank, 4, list(CASES), timeout=400)
    for rank, per_case in enumerate(results):
        for name, r in per_case.items():
            where = f"rank {rank}, {name}: {r}"
            tol = 1e-5 if CASES[name].clip is not None else 0.0
            for key in ("vs_torch", "vs_ours"):
                equal, worst = r[key]  # type: ignore[misc]
                assert equal if tol == 0.0 else worst <= tol, where
            assert r["meshes"] == ["[0, 1, 2, 3]"], where  # the mesh flattened
            assert r["placements"] == ["(Shard(dim=0),)"] or name == "shard_dim1", where
            assert r["local"] <= r["chunk_of_4"] < r["chunk_of_2"], where  # type: ignore[operator]
    for name in CASES:  # the four ranks together hold every element once
        assert sum(r[name]["local"] for r in results) == results[0][name]["total"]  # type: ignore[misc]
