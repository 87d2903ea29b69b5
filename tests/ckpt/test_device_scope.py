"""ckpt's and zero_optim's object collectives run on the model's device, not the current one.

torch's object collectives put their bytes on ``torch.cuda.current_device()``
when the backend is NCCL; under torchrun without ``torch.cuda.set_device``
that is cuda:0 on every rank. ``ckpt.save``/``load`` therefore run with the
model's CUDA device current, and zero_optim passes its parameters' device
explicitly. CUDA is stubbed here: the device is a ``torch.device`` the test
names, the context manager a recorder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ckpt
from ckpt import _comm
from ckpt._commit import save_load
from tests.ranks import run_ranks
from zero_optim import _collectives

CUDA3 = torch.device("cuda", 3)


class _OnCuda3(nn.Module):
    """A module whose parameters report cuda:3 (their storage stays on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def parameters(self, recurse: bool = True) -> Iterator[Any]:  # type: ignore[override]
        class _P:
            device = CUDA3

        yield _P()


def test_device_of() -> None:
    cpu = nn.Linear(2, 2)
    assert _comm.device_of({"model": cpu, "step": 3}) is None
    assert _comm.device_of({"step": 3, "model": _OnCuda3()}) == CUDA3
    opt = torch.optim.SGD(cpu.parameters(), lr=0.1)
    assert _comm.device_of({"optim": opt}) is None


def test_save_and_load_run_with_the_models_device_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    current: list[torch.device | None] = [None]
    seen: list[tuple[str, torch.device | None]] = []

    @contextlib.contextmanager
    def device(d: torch.device) -> Iterator[None]:
        current[0], before = d, current[0]
        try:
            yield
        finally:
            current[0] = before

    def watch(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            seen.append((name, current[0]))
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(save_load, "device_of", lambda state: CUDA3)
    monkeypatch.setattr(save_load, "to_state_dict", watch("state", save_load.to_state_dict))
    monkeypatch.setattr(save_load, "read_chunks", watch("read", save_load.read_chunks))
    monkeypatch.setattr(save_load, "_open_checkpoint", watch("open", save_load._open_checkpoint))
    model = nn.Linear(2, 2)
    ckpt.save({"model": model}, tmp_path / "c")
    ckpt.load({"model": model}, tmp_path / "c")
    assert [n for n, _ in seen] == ["state", "open", "state", "read"]
    assert all(d == CUDA3 for _, d in seen), seen
    assert current[0] is None  # restored afterwards


def test_zero_optim_object_device(monkeypatch: pytest.MonkeyPatch) -> None:
    group: Any = object()
    monkeypatch.setattr(dist, "get_backend", lambda g: "gloo")
    assert _collectives._object_device(group, CUDA3) == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda g: "nccl")
    assert _collectives._object_device(group, CUDA3) == CUDA3  # not the current device
    assert _collectives._object_device(group, None) is None  # unknown: torch's choice
    monkeypatch.setattr(dist, "get_backend", lambda g: "cpu:gloo,cuda:nccl")
    assert _collectives._object_device(group, CUDA3) == torch.device("cpu")


def _fsdp_device_of_rank() -> tuple[str | None, str | None]:
    from fsdp import CPUOffload
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    model = FSDP(nn.Linear(2, 2), cpu_offload=CPUOffload(offload_params=True))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _comm.device_of({"optim": optim, "model": model})
    # The stub: a CPU-offloaded model that computes on cuda:3. Its parameters are on the
    # CPU, so only its compute device tells where its collectives belong.
    model.compute_device = CUDA3
    after = _comm.device_of({"optim": optim, "model": model})
    return None if before is None else str(before), None if after is None else str(after)


def test_device_of_an_offloaded_fsdp_model_is_its_compute_device() -> None:
    assert run_ranks(_fsdp_device_of_rank, 1) == [(None, "cuda:3")]
