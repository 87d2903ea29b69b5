"""save/load/verify in one process (no process group): round trips, errors, corruption."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import ckpt
from tests.ckpt._common import (
    assert_same,
    linear,
    make_model,
    make_optimizer,
    params,
    train_step,
)


def _trained(seed: int = 0, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = make_model(seed)
    optim = make_optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    for step in range(steps):
        train_step(model, optim, step)
        sched.step()
    return model, optim, sched


def test_round_trip_resumes_identically(tmp_path: Path) -> None:
    model, optim, sched = _trained()
    extra = torch.arange(5.0)
    state = {"model": model, "optim": optim, "sched": sched, "step": 3, "extra": extra}
    lr_at_save = optim.param_groups[0]["lr"]
    info = ckpt.save(state, tmp_path / "c")
    assert info.path == tmp_path / "c" and info.manifest is not None
    assert {f.name for f in info.manifest.files} == {".metadata", "ckpt-index.bin", "__0_0.distcp"}
    assert sorted(os.listdir(tmp_path)) == ["c"]  # nothing left beside it

    train_step(model, optim, 3)  # the uninterrupted run
    sched.step()
    expected = params(model)

    model2, optim2, sched2 = _trained(seed=7, steps=0)  # fresh, other init, no state yet
    extra2 = torch.zeros(5)
    state2 = {"model": model2, "optim": optim2, "sched": sched2, "step": 0, "extra": extra2}
    ckpt.load(state2, tmp_path / "c")
    assert state2["step"] == 3 and torch.equal(extra2, torch.arange(5.0))  # in place
    assert sched2.last_epoch == 3 and optim2.param_groups[0]["lr"] == lr_at_save
    train_step(model2, optim2, 3)
    sched2.step()
    assert_same(params(model2), expected)
    assert optim2.param_groups[0]["lr"] == optim.param_groups[0]["lr"]


def test_optimizer_state_is_keyed_by_parameter_names(tmp_path: Path) -> None:
    model, optim, _ = _trained()
    ckpt.save({"model": model, "optim": optim}, tmp_path / "c")
    keys = set(FileSystemReader(str(tmp_path / "c")).read_metadata().state_dict_metadata)
    assert "optim.state.0.weight.exp_avg" in keys and "model.2.bias" in keys
    # The model alone loads from a training checkpoint (the optimizer entry is skipped).
    fresh = make_model(5)
    ckpt.load({"model": fresh}, tmp_path / "c")
    assert_same(params(fresh), params(model))


def test_optimizer_without_its_model_is_refused(tmp_path: Path) -> None:
    _, optim, _ = _trained()
    with pytest.raises(ValueError, match=r"no nn\.Module in the checkpoint state owns"):
        ckpt.save({"optim": optim}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_state_must_be_a_dict_with_string_keys(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="state must be a dict"):
        ckpt.save([make_model(0)], tmp_path / "c")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="state keys must be non-empty strings"):
        ckpt.save({1: make_model(0)}, tmp_path / "c")  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="unknown checksum 'md5'"):
        ckpt.save({"m": make_model(0)}, tmp_path / "c", checksum="md5")


def test_existing_paths_and_overwrite(tmp_path: Path) -> None:
    model = make_model(0)
    path = tmp_path / "c"
    ckpt.save({"model": model}, path, checksum="blake2b")
    with pytest.raises(ckpt.CheckpointExistsError, match="pass overwrite=True"):
        ckpt.save({"model": model}, path)
    with torch.no_grad():
        linear(model, 0).weight.add_(1.0)
    info = ckpt.save({"model": model}, path, overwrite=True)
    assert info.manifest is not None and info.manifest.checksum is ckpt.Checksum.CRC32
    assert sorted(os.listdir(tmp_path)) == ["c"]
    fresh = make_model(1)
    ckpt.load({"model": fresh}, path)
    assert_same(params(fresh), params(model))

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(ckpt.CheckpointExistsError, match="is not a ckpt checkpoint"):
        ckpt.save({"model": model}, tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"


def test_paths_that_are_not_checkpoints(tmp_path: Path) -> None:
    state = {"model": make_model(0)}
    with pytest.raises(ckpt.NotACheckpointError, match="no such file or directory"):
        ckpt.load(state, tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ckpt.NotACheckpointError, match="it is a file"):
        ckpt.load(state, tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.NotACheckpointError, match=r"has no ckpt-manifest\.json"):
        ckpt.load(state, tmp_path / "empty")

    # A checkpoint written by DCP directly: refused, unless verify=False.
    model = make_model(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(ckpt.NotACheckpointError, match="pass verify=False"):
        ckpt.load(state, tmp_path / "dcp")
    info = ckpt.load(state, tmp_path / "dcp", verify=False)
    assert info.manifest is None
    assert_same(params(state["model"]), params(model))


def test_key_and_shape_mismatches_are_listed(tmp_path: Path) -> None:
    model = make_model(0)
    ckpt.save({"model": model, "step": 1}, tmp_path / "c")
    before = params(make_model(9))

    other = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4))  # last layer 3 -> 4
    other.register_buffer("scale", torch.rand(3))
    with pytest.raises(ckpt.StateDictMismatchError) as info:
        ckpt.load({"model": other}, tmp_path / "c")
    assert {m.key for m in info.value.shape_mismatches} == {"model.2.weight", "model.2.bias"}
    assert "model.2.weight: checkpoint has shape [3, 12], the state being loaded has [4, 12]" in (
        str(info.value)
    )

    renamed = nn.ModuleDict({"enc": nn.Linear(6, 12), "dec": nn.Linear(12, 3)})
    with pytest.raises(ckpt.StateDictMismatchError) as info:
        ckpt.load({"model": renamed}, tmp_path / "c")
    assert info.value.other_model
    assert set(info.value.missing) == {
        "model.enc.weight",
        "model.enc.bias",
        "model.dec.weight",
        "model.dec.bias",
    }
    assert "model.0.weight" in info.value.unexpected and "model.scale" in info.value.unexpected

    bigger = make_model(9)
    bigger.add_module("head", nn.Linear(3, 1))
    with pytest.raises(ckpt.StateDictMismatchError, match=r"Missing from the checkpoint \(2\)"):
        ckpt.load({"model": bigger, "step": 0}, tmp_path / "c")
    assert_same({k: v for k, v in params(bigger).items() if "head" not in k}, before)  # untouched
    state: dict[str, Any] = {"model": bigger, "step": 0}
    ckpt.load(state, tmp_path / "c", strict=False)
    assert state["step"] == 1
    assert torch.equal(linear(bigger, 0).weight, linear(model, 0).weight)

    with pytest.raises(ckpt.StateDictMismatchError, match="plain object in the other"):
        ckpt.load({"step": torch.zeros(1)}, tmp_path / "c")


def _damage(path: Path, how: str) -> str:
    """Damage one file of the checkpoint at ``path``; return the damaged file's name."""
    data_file = path / "__0_0.distcp"
    if how == "truncate":
        data_file.write_bytes(data_file.read_bytes()[:-10])
    elif how == "flip":
        raw = bytearray(data_file.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        data_file.write_bytes(bytes(raw))
    elif how == "delete":
        (path / ".metadata").unlink()
        return ".metadata"
    elif how == "extra":
        (path / "__9_0.distcp").write_bytes(b"junk")
        return "__9_0.distcp"
    elif how == "manifest":
        (path / ckpt.MANIFEST_NAME).write_text('{"format": "ckpt-manifest", "vers')
        return ckpt.MANIFEST_NAME
    return data_file.name


@pytest.mark.parametrize("how", ["truncate", "flip", "delete", "extra", "manifest"])
def test_corruption_is_detected_and_nothing_loads(tmp_path: Path, how: str) -> None:
    model, optim, _ = _trained()
    ckpt.save({"model": model, "optim": optim}, tmp_path / "c")
    ckpt.verify(tmp_path / "c")
    bad = _damage(tmp_path / "c", how)

    fresh = make_model(4)
    fresh_optim = make_optimizer(fresh)
    before = params(fresh)
    with pytest.raises(ckpt.CorruptCheckpointError) as info:
        ckpt.load({"model": fresh, "optim": fresh_optim}, tmp_path / "c")
    assert [p.name for p in info.value.problems] == [bad]
    assert bad in str(info.value)
    assert_same(params(fresh), before)
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.verify(tmp_path / "c")


def test_async_save_snapshots_state_and_serialises_saves(tmp_path: Path) -> None:
    model, optim, _ = _trained()
    snapshot = params(model)
    first = ckpt.async_save({"model": model, "optim": optim}, tmp_path / "a")
    with torch.no_grad():  # training goes on while the save runs
        for p in model.parameters():
            p.add_(1.0)
    second = ckpt.async_save({"model": model}, tmp_path / "b")
    assert first.done()  # the second save waited for the first
    info = second.wait()
    assert info.path == tmp_path / "b" and second.done() and "committed" in repr(second)
    assert ckpt.wait_pending() is None

    fresh = make_model(8)
    ckpt.load({"model": fresh}, tmp_path / "a")
    assert_same(params(fresh), snapshot)
    ckpt.load({"model": fresh}, tmp_path / "b")
    assert_same(params(fresh), params(model))


def test_async_save_failure_surfaces(tmp_path: Path) -> None:
    model = make_model(0)
    ckpt.save({"model": model}, tmp_path / "c")
    with pytest.raises(ckpt.CheckpointExistsError):  # decided before returning
        ckpt.async_save({"model": model}, tmp_path / "c")

    class Unpicklable:  # copies fine when staged, fails when written in the background
        def __deepcopy__(self, memo: Any) -> Unpicklable:
            return self

        def __reduce__(self) -> Any:
            raise RuntimeError("cannot pickle this")

    handle = ckpt.async_save({"model": model, "bad": [Unpicklable()]}, tmp_path / "d")
    with pytest.raises(Exception, match="cannot pickle this"):
        handle.wait()
    assert sorted(os.listdir(tmp_path)) == ["c"]  # nothing committed, nothing left over
    assert ckpt.wait_pending() is None  # the failure was consumed by wait()
    ckpt.save({"model": model}, tmp_path / "d")
    assert sorted(os.listdir(tmp_path)) == ["c", "d"]


def test_release_staging_buffers_frees_the_host_copy(tmp_path: Path) -> None:
    from ckpt._commit import staging

    model = make_model(0)
    ckpt.async_save({"model": model}, tmp_path / "a").wait()
    assert staging._Buffers.stager is not None  # kept for the next async save
    ckpt.release_staging_buffers()
    assert staging._Buffers.stager is None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ckpt.async_save({"model": model}, tmp_path / "b").wait()  # allocates anew
    fresh = make_model(1)
    ckpt.load({"model": fresh}, tmp_path / "b")
    assert_same(params(fresh), params(model))
    ckpt.release_staging_buffers()


def test_single_process_save_is_silent(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save({"model": make_model(0)}, tmp_path / "c")
        ckpt.load({"model": make_model(1)}, tmp_path / "c")


class _Counter:
    """An object ckpt knows nothing about until an adapter is registered for it."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.loaded_from_world_size: int | None = None


class _CounterAdapter:
    def applies_to(self, obj: object, ctx: ckpt.StateContext) -> bool:
        return isinstance(obj, _Counter)

    def state_dict(self, obj: _Counter, ctx: ckpt.StateContext) -> dict[str, Any]:
        if ctx.manifest is not None:  # loading: the saved checkpoint's manifest
            obj.loaded_from_world_size = ctx.manifest.world_size
        return {"count": torch.tensor(obj.count)}

    def load_state_dict(
        self, obj: _Counter, state_dict: dict[str, Any], ctx: ckpt.StateContext
    ) -> None:
        obj.count = int(state_dict["count"].item())


def test_registered_adapters_plug_in(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"has no method applies_to\(\)"):
        ckpt.register_adapter(object())  # type: ignore[arg-type]
    ckpt.register_adapter(_CounterAdapter())
    ckpt.save({"counter": _Counter(41)}, tmp_path / "c")
    keys = set(FileSystemReader(str(tmp_path / "c")).read_metadata().state_dict_metadata)
    assert keys == {"counter.count"}
    counter = _Counter(0)
    ckpt.load({"counter": counter}, tmp_path / "c")
    assert counter.count == 41 and counter.loaded_from_world_size == 1


def test_torch_record_crc_is_off_only_in_the_thread_that_writes(tmp_path: Path) -> None:
    """ckpt's writer skips torch.save's per-record CRC (the manifest checksums every
    byte) in the thread that writes and puts it back as found; torch keeps the option
    per thread, so the caller's own setting (and an async_save's caller's) stays. (A
    pickled value is always torch.save'd; tensors mostly from templates made by one.)"""
    model = make_model(0)
    seen: list[bool] = []
    real_save = torch.save

    def spying_save(*args: Any, **kwargs: Any) -> None:
        seen.append(torch.serialization.get_crc32_options())
        real_save(*args, **kwargs)

    torch.save = spying_save  # type: ignore[assignment]
    try:
        for before in (True, False):
            torch.serialization.set_crc32_options(before)
            ckpt.save({"model": model, "step": 3}, tmp_path / f"s{before}")
            assert torch.serialization.get_crc32_options() is before
            pending = ckpt.async_save({"model": model, "step": 3}, tmp_path / f"a{before}")
            assert torch.serialization.get_crc32_options() is before
            pending.wait()
    finally:
        torch.save = real_save
        torch.serialization.set_crc32_options(True)
    assert seen and not any(seen), seen
    for name in ("sTrue", "aTrue"):
        fresh = make_model(1)
        ckpt.load({"model": fresh}, tmp_path / name)  # verified, then read by torch.load
        assert_same(params(fresh), params(model))
