"""Which device a unit computes on, and that its events go to that device's stream.

CUDA is stubbed (``torch.cuda.is_available``, ``current_device``,
``device_count``) so the choice itself is tested on a CPU machine; with a GPU,
``tests/gpu`` runs the same paths for real. See [Note: choosing the CUDA
device] in ``fsdp/_device.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fsdp._runtime._device import default_cuda_device
from fsdp._runtime._root_context import RateLimiter
from fsdp._wrapper._init import resolve_compute_device

CPU_PARAMS = list(nn.Linear(2, 2).parameters())


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Pretend 4 GPUs are visible; ``state["current"]`` is the current device."""
    state = {"current": 0, "count": 4}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return state


@pytest.mark.parametrize(
    "case",
    [
        ("3", 0, None, "cuda:3"),  # torchrun, no set_device: LOCAL_RANK, not cuda:0
        ("3", 0, "cuda", "cuda:3"),  # "cuda" without an index: the same choice
        ("3", 0, torch.device("cuda"), "cuda:3"),
        ("3", 2, None, "cuda:2"),  # the caller's set_device wins
        (None, 1, None, "cuda:1"),  # no torchrun: the current device, as torch's FSDP
        (None, 0, None, "cuda:0"),
        ("3", 0, 1, "cuda:1"),  # an explicit index wins over everything
        ("3", 0, "cuda:2", "cuda:2"),
        ("3", 0, torch.device("cuda", 0), "cuda:0"),
        ("3", 0, "cpu", "cpu"),
    ],
)
def test_compute_device(
    fake_cuda: Any, monkeypatch: pytest.MonkeyPatch, case: tuple[str | None, int, object, str]
) -> None:
    local_rank, current, device_id, want = case  # LOCAL_RANK, current device, argument, choice
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    fake_cuda["current"] = current
    assert resolve_compute_device(CPU_PARAMS, [], device_id) == torch.device(want)


def test_local_rank_beyond_the_visible_gpus(
    fake_cuda: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(
        RuntimeError, match=r"LOCAL_RANK=4 .* 4 CUDA device.*torch\.cuda\.set_device"
    ):
        resolve_compute_device(CPU_PARAMS, [], None)


def test_local_rank_not_an_integer(fake_cuda: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(ValueError, match=r"LOCAL_RANK='first'.*torch\.cuda\.set_device"):
        default_cuda_device()


def test_without_cuda_local_rank_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_compute_device(CPU_PARAMS, [], None) == torch.device("cpu")


class _FakeEvent:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def record(self, stream: Any = None) -> None:
        self.log.append(("record", stream))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self))


class _FakeCudaModule:
    """The three things the rate limiter uses, recording which device they were asked for."""

    def __init__(self) -> None:
        self.log: list[Any] = []

    def Event(self) -> _FakeEvent:  # noqa: N802 - torch.cuda.Event's name
        return _FakeEvent(self.log)

    def current_stream(self, device: torch.device | None = None) -> str:
        return f"stream of {device}"


def test_rate_limiter_records_on_the_units_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCudaModule()
    monkeypatch.setattr(torch, "get_device_module", lambda device: fake)
    limiter = RateLimiter(torch.device("cuda", 3), enabled=True)
    limiter.record_free()
    limiter.record_free()
    assert fake.log == [("record", "stream of cuda:3")] * 2
    limiter.throttle()  # two frees pending: waits for the oldest
    assert fake.log[-1][0] == "synchronize"
    fake.log.clear()
    limiter.throttle()  # one left: no wait
    assert fake.log == []
    disabled = RateLimiter(torch.device("cuda", 3), enabled=False)
    disabled.record_free()
    disabled.throttle()
    assert fake.log == []
