"""ckpt.save copies each unit's chunks to the host as it makes them.

On CUDA, a save that kept every chunk on the device until DCP wrote it held
about the model's shard again (and Adam's two moments: 3x for fp32 Adam) next
to the model, and copied CPUOffload shards onto the GPU. The device is stubbed
here: after training, each unit's compute device is set to ``meta``, a device
that is not the CPU, where any tensor moved "to the compute device" lands and
can be seen. The gloo exchange itself runs on the CPU, so a save that offloads
unit by unit produces only CPU tensors, and one that does not produces meta
ones. Loading is checked to still round-trip.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

import ckpt
from ckpt._wrappers.adapters import to_state_dict
from tests.ckpt._wrappers import full_weights, same, step, wrap
from tests.ranks import run_ranks


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _leaves(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _leaves(v)]
    if isinstance(tree, DTensor):
        return [tree.to_local()]
    return [tree] if isinstance(tree, torch.Tensor) else []


def _rank(kind: str, offload_params: bool, folder: str) -> int:
    from fsdp import CPUOffload
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from fsdp.wrap import ModuleWrapPolicy
    from tests.fsdp._common import Block, make_net

    if offload_params:
        model: Any = FSDP(
            make_net(0),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            cpu_offload=CPUOffload(offload_params=True),
            use_orig_params=kind == "fsdp-orig",
        )
        optim: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        model, optim = wrap(kind)
    step(model, optim, 0)
    want = full_weights(model)
    units = [m._fsdp_state.unit for m in FSDP.fsdp_modules(model) if m._fsdp_state.unit]
    real = [u.config for u in units]
    for unit in units:  # the stub: "the device" is now visibly not the CPU
        unit.config = dataclasses.replace(unit.config, compute_device=torch.device("meta"))
    try:
        state_dict, _ = to_state_dict({"model": model, "optim": optim}, None)
    finally:
        for unit, config in zip(units, real, strict=True):
            unit.config = config
    leaves = _leaves(state_dict)
    off = [t.device for t in leaves if t.device.type != "cpu"]
    assert not off, f"{len(off)} of {len(leaves)} saved tensors left the host: {off[:3]}"
    ckpt.save({"model": model, "optim": optim}, Path(folder) / "c")
    fresh, fresh_optim = wrap(kind, seed=1)
    ckpt.load({"model": fresh, "optim": fresh_optim}, Path(folder) / "c")
    assert same(full_weights(fresh), want)
    return len(leaves)


@pytest.mark.parametrize(
    ("kind", "offload_params"), [("fsdp", False), ("fsdp-orig", False), ("fsdp", True)]
)
def test_save_makes_host_chunks_unit_by_unit(
    kind: str, offload_params: bool, tmp_path: Path
) -> None:
    counts = run_ranks(_rank, 2, kind, offload_params, str(tmp_path))
    assert counts[0] > 0
