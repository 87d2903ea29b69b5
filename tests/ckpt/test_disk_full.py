"""A save onto a full disk names it: "no space left on device at PATH: the checkpoint
needs about N bytes, M are free", nothing of the failed save is left, and the previous
checkpoint stays loadable ([Note: naming a full disk] in ``ckpt/disk_space.py``).

No filesystem is filled: the free space is what a patched ``os.statvfs`` reports (the
check before writing), or the save's file writes are given a byte budget after which every
write fails with ``ENOSPC``, as a full disk's writes do (the translation after the
fact). So CI needs no mount.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ckpt
from ckpt._format import data_file, disk_space
from ckpt._format.safe_unpickling import read_metadata
from tests.ranks import run_ranks


class _Budget:
    """The bytes every file a save writes may still take, together."""

    left = 0


@contextlib.contextmanager
def _disk_of(budget: int) -> Iterator[None]:
    """A save's writes (data files, .metadata, index) fail with ENOSPC, as a full
    disk's do, after ``budget`` bytes (all files together)."""
    original = data_file._Out._write

    def write(self: Any, view: memoryview) -> None:
        if view.nbytes > _Budget.left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _Budget.left -= view.nbytes
        original(self, view)

    _Budget.left = budget
    data_file._Out._write = write  # type: ignore[method-assign]
    try:
        yield
    finally:
        data_file._Out._write = original  # type: ignore[method-assign]


class _StatVfs:
    def __init__(self, free: int) -> None:
        self.f_bavail, self.f_frsize = free, 1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def manager_steps(root: Path) -> list[int]:
    return ckpt.CheckpointManager(root).steps()


def _left_behind(root: Path) -> list[str]:
    """What a failed save left in ``root`` (a manager's own hold on it is not that)."""
    return sorted(
        p.name for p in root.iterdir() if p.name.startswith(".") and p.name != ".ckpt-job.lease"
    )


def _assert_step1_loads(root: Path, model: torch.nn.Module) -> None:
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    state = {"model": fresh, "step": 0}
    assert ckpt.CheckpointManager(root).load_latest(state) == 1
    assert state["step"] == 1
    for (name, want), got in zip(
        model.state_dict().items(), fresh.state_dict().values(), strict=True
    ):
        assert torch.equal(got, want), name


def test_checked_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    manager = ckpt.CheckpointManager(tmp_path / "run")
    manager.save(1, {"model": model, "step": 1})
    monkeypatch.setattr(disk_space.os, "statvfs", lambda path: _StatVfs(10_000))
    with pytest.raises(ckpt.DiskFullError) as caught:
        manager.save(2, {"model": model, "step": 2})
    monkeypatch.undo()
    err = caught.value
    target = tmp_path / "run" / "step_00000002"
    assert str(err).startswith(
        f"no space left on device at {target}: the checkpoint needs about {err.needed} bytes"
    ), err
    assert "10000 bytes (9.8 KiB) are free" in str(err)
    # The estimate is the tensors' bytes plus DCP's framing, not a guess off by much.
    assert err.needed is not None
    assert _model_bytes(model) < err.needed < _model_bytes(model) + 16 * 1024
    assert err.free == 10_000 and err.errno == errno.ENOSPC
    assert isinstance(err, ckpt.CheckpointError)
    assert manager.steps() == [1] and _left_behind(tmp_path / "run") == []
    _assert_step1_loads(tmp_path / "run", model)


def _first_tensor_offset(path: Path) -> int:
    """Where DCP put the first tensor in the data file (the pickled values come first)."""
    metadata = read_metadata(path)
    return min(
        int(info.offset)
        for index, info in (metadata.storage_data or {}).items()
        if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata)
    )


@pytest.mark.parametrize("where", ["tensor data", "metadata"])
def test_translated_from_the_failed_write(tmp_path: Path, where: str) -> None:
    model = _model()
    manager = ckpt.CheckpointManager(tmp_path / "run")
    manager.save(1, {"model": model, "step": 1})
    step1 = tmp_path / "run" / "step_00000001"
    data_bytes = sum(p.stat().st_size for p in step1.glob("*.distcp"))
    # Inside the first tensor's 16 KiB of data, or once the data files are written, in
    # the .metadata rank 0 writes at the commit.
    budget = _first_tensor_offset(step1) + 1000 if where == "tensor data" else data_bytes + 64
    with _disk_of(budget), pytest.raises(ckpt.DiskFullError) as caught:
        manager.save(2, {"model": model, "step": 2})
    err = caught.value
    assert str(err).startswith(
        f"no space left on device at {tmp_path / 'run' / 'step_00000002'}: the checkpoint "
        "needs about"
    ), err
    assert "are free; nothing of this save was kept (an earlier checkpoint is intact)" in str(err)
    chain = []
    cause: BaseException | None = err
    while cause is not None:
        chain.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    assert any(os.strerror(errno.ENOSPC) in text for text in chain), chain
    assert manager.steps() == [1] and _left_behind(tmp_path / "run") == []
    _assert_step1_loads(tmp_path / "run", model)


def test_translated_when_the_manifest_does_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckpt._commit.save_load as checkpoint_module

    def full(directory: Path, manifest: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))

    model = _model()
    ckpt.save({"model": model, "step": 1}, tmp_path / "a")
    monkeypatch.setattr(checkpoint_module, "write_manifest", full)
    with pytest.raises(ckpt.DiskFullError, match=r"no space left on device at .*/b: "):
        ckpt.save({"model": model}, tmp_path / "b")
    with pytest.raises(ckpt.DiskFullError):
        ckpt.save({"model": _model(), "step": 2}, tmp_path / "a", overwrite=True)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    state = {"model": _model(), "step": 0}
    ckpt.load(state, tmp_path / "a")
    assert state["step"] == 1


def _rank_full_disk(root: str, how: str) -> str:
    model = _model()
    manager = ckpt.CheckpointManager(Path(root))
    manager.save(1, {"model": model, "step": 1})
    with contextlib.ExitStack() as stack:
        if how == "statvfs":
            real = disk_space.os.statvfs
            disk_space.os.statvfs = lambda path: _StatVfs(1000)  # type: ignore[assignment]
            stack.callback(setattr, disk_space.os, "statvfs", real)
        elif dist.get_rank() == 1:  # only rank 1's writes fail
            stack.enter_context(_disk_of(300))
        try:
            manager.save(2, {"model": model, "step": 2})
        except ckpt.DiskFullError as e:
            message = str(e)
        else:
            message = "saved"
    dist.barrier()
    state = {"model": _model(), "step": 0}
    assert manager.load_latest(state) == 1 and state["step"] == 1
    return message


@pytest.mark.parametrize("how", ["statvfs", "rank 1 writes"])
def test_every_rank_names_it(tmp_path: Path, how: str) -> None:
    messages = run_ranks(_rank_full_disk, 2, str(tmp_path / "run"), how)
    assert messages[0] == messages[1], messages
    assert messages[0].startswith(
        f"no space left on device at {tmp_path / 'run' / 'step_00000002'}: the checkpoint "
        "needs about"
    ), messages
    assert _left_behind(tmp_path / "run") == []
    assert manager_steps(tmp_path / "run") == [1]
