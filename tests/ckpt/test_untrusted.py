"""Loading never runs code from a checkpoint: forged metadata, forged values, keyed manifest."""

from __future__ import annotations

import dataclasses
import io
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

import ckpt
from ckpt._format import safe_unpickling
from tests.ckpt._common import assert_same, make_model, make_optimizer, params, train_step
from tests.ckpt._forge import Payload, drop_index, forge_metadata, rehash_manifest
from tests.ranks import run_ranks

KEY = b"0123456789abcdef-test-key"


@dataclasses.dataclass
class Custom:
    """A user type saved as a plain value: refused unless allow-listed."""

    lr: float


def _saved(path: Path, **extra: object) -> torch.nn.Module:
    model = make_model(0)
    optim = make_optimizer(model)
    train_step(model, optim, 0)
    ckpt.save({"model": model, "optim": optim, "step": 1, **extra}, path)
    return model


def test_forged_metadata_runs_code_in_torch_but_not_in_ckpt(tmp_path: Path) -> None:
    path, marker = tmp_path / "c", tmp_path / "ran"
    saved = _saved(path)
    forge_metadata(path, marker)
    # The forgery is live: torch's own reader runs it and returns the genuine metadata.
    FileSystemReader(path).read_metadata()
    assert marker.is_dir()
    marker.rmdir()

    # ckpt's load reads the index, never DCP's pickle; verify checks the pickle.
    model = make_model(1)
    ckpt.load({"model": model}, path)
    assert_same(params(model), params(saved))
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"posix\.mkdir|os\.mkdir") as info:
        ckpt.verify(path)
    assert info.value.item == ".metadata"
    # Without an index (a checkpoint of an older ckpt), the load reads the pickle: refused.
    drop_index(path)
    rehash_manifest(path)
    model = make_model(1)
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"posix\.mkdir|os\.mkdir") as info:
        ckpt.load({"model": model}, path)
    assert info.value.item == ".metadata"
    with pytest.raises(ckpt.UnsafeCheckpointError):
        ckpt.load({"model": model}, path, verify=False)
    assert not marker.exists()
    assert_same(params(model), params(make_model(1)))  # nothing loaded


def test_forged_value_runs_code_in_torch_but_not_in_ckpt(tmp_path: Path) -> None:
    path, marker = tmp_path / "c", tmp_path / "ran"
    # save pickles the payload (its __reduce__ only describes the call), as a forger's would
    _saved(path, extra=Payload(marker))
    assert not marker.exists()
    sd: dict[str, object] = {"extra": None}
    dcp_load(sd, storage_reader=FileSystemReader(path), planner=DefaultLoadPlanner(), no_dist=True)
    assert marker.is_dir()  # torch's load (weights_only=False for objects) ran it
    marker.rmdir()

    with pytest.raises(ckpt.UnsafeCheckpointError, match="mkdir") as info:
        ckpt.load({"extra": None}, path)
    assert info.value.item == "extra"
    with pytest.raises(ckpt.UnsafeCheckpointError, match="mkdir"):
        ckpt.verify(path)
    assert not marker.exists()


def test_allow_list_admits_only_what_is_named(tmp_path: Path) -> None:
    path = tmp_path / "c"
    _saved(path, extra=Custom(0.5))
    with pytest.raises(ckpt.UnsafeCheckpointError, match="Custom") as info:
        ckpt.load({"extra": None}, path)
    assert "safe_globals" in str(info.value)
    state: dict[str, object] = {"extra": None, "step": 0}
    ckpt.load(state, path, safe_globals=[Custom])
    assert state == {"extra": Custom(0.5), "step": 1}
    ckpt.verify(path, safe_globals=[Custom])


def test_broken_metadata_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "c"
    _saved(path)
    drop_index(path)  # the load reads .metadata only without an index
    meta = path / ".metadata"
    good = meta.read_bytes()
    for bad in (good[: len(good) // 2], b"", pickle.dumps({"not": "metadata"}), good + b"x"):
        meta.write_bytes(bad)
        rehash_manifest(path)
        with pytest.raises(ckpt.CorruptCheckpointError, match=r"\.metadata: unreadable"):
            ckpt.load({"model": make_model(1)}, path)
        with pytest.raises(ckpt.CorruptCheckpointError, match=r"\.metadata: unreadable"):
            ckpt.verify(path)


def test_broken_index_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "c"
    _saved(path)
    index = path / "ckpt-index.bin"
    good = index.read_bytes()
    for bad in (good[: len(good) // 2], b"", b"CKI1" + good[4:40], good[:-8]):
        index.write_bytes(bad)
        rehash_manifest(path)
        model = make_model(1)
        with pytest.raises(ckpt.CorruptCheckpointError, match=r"ckpt-index\.bin: unreadable"):
            ckpt.load({"model": model}, path)
        assert_same(params(model), params(make_model(1)))  # nothing loaded


def test_data_file_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c"
    _saved(path)
    index = path / "ckpt-index.bin"
    index.write_bytes(index.read_bytes().replace(b"__0_0.distcp", b"../_0.distcp"))
    rehash_manifest(path)
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"\.\./_0\.distcp"):
        ckpt.load({"model": make_model(1)}, path)
    drop_index(path)
    md = FileSystemReader(path).read_metadata()
    for info in md.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(md))
    rehash_manifest(path)
    with pytest.raises(ckpt.UnsafeCheckpointError, match="elsewhere"):
        ckpt.load({"model": make_model(1)}, path)


@pytest.mark.parametrize("indexed", [True, False])
def test_metadata_is_unpickled_at_most_once_per_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, indexed: bool
) -> None:
    """With an index, a load unpickles no metadata at all; without, once per rank."""
    path = tmp_path / "c"
    model = _saved(path)
    if not indexed:
        drop_index(path)
        rehash_manifest(path)
    calls = []
    real = safe_unpickling._MetadataUnpickler.load

    def counting(self: safe_unpickling._MetadataUnpickler) -> object:
        calls.append(1)
        return real(self)

    monkeypatch.setattr(safe_unpickling._MetadataUnpickler, "load", counting)
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unrestricted unpickling"))
    fresh = make_model(1)
    ckpt.load({"model": fresh, "optim": make_optimizer(fresh)}, path)
    assert len(calls) == (0 if indexed else 1)
    assert_same(params(fresh), params(model))


def test_keyed_manifest(tmp_path: Path) -> None:
    path, marker = tmp_path / "c", tmp_path / "ran"
    model = make_model(0)
    info = ckpt.save({"model": model}, path, key=KEY)
    assert info.manifest is not None and info.manifest.mac is not None
    assert info.manifest.checksum is ckpt.Checksum.BLAKE2B
    fresh = make_model(1)
    ckpt.load({"model": fresh}, path, key=KEY)
    assert_same(params(fresh), params(model))
    ckpt.verify(path, key=KEY)
    with pytest.raises(ckpt.SignatureError, match="does not match"):
        ckpt.verify(path, key=b"another key of 16+ bytes")
    # A forger rewrites the metadata and recomputes every digest: without the key the
    # HMAC no longer matches, and nothing is unpickled.
    forge_metadata(path, marker)
    with pytest.raises(ckpt.SignatureError):
        ckpt.load({"model": make_model(1)}, path, key=KEY)
    with pytest.raises(ckpt.SignatureError):
        ckpt.verify(path, key=KEY)
    assert not marker.exists()
    # An unsigned checkpoint is refused when a key is required.
    ckpt.save({"model": model}, tmp_path / "plain")
    with pytest.raises(ckpt.SignatureError, match="not signed"):
        ckpt.load({"model": make_model(1)}, tmp_path / "plain", key=KEY)
    with pytest.raises(ValueError, match="blake2b"):
        ckpt.save({"model": model}, tmp_path / "crc", key=KEY, checksum="crc32")
    with pytest.raises(ValueError, match="verify=True"):
        ckpt.load({"model": model}, path, key=KEY, verify=False)
    with pytest.raises(ValueError, match="16"):
        ckpt.save({"model": model}, tmp_path / "short", key=b"short")


def test_async_save_signs_too(tmp_path: Path) -> None:
    model = make_model(0)
    info = ckpt.async_save({"model": model}, tmp_path / "a", key=KEY).wait()
    assert info.manifest is not None and info.manifest.mac is not None
    fresh = make_model(1)
    ckpt.load({"model": fresh}, tmp_path / "a", key=KEY)
    assert_same(params(fresh), params(model))


def test_manager_signs_and_requires_its_key(tmp_path: Path) -> None:
    manager = ckpt.CheckpointManager(tmp_path / "run", key=KEY)
    model = make_model(0)
    manager.save(3, {"model": model})
    fresh = make_model(1)
    assert manager.load_latest({"model": fresh}) == 3
    assert_same(params(fresh), params(model))
    unkeyed = ckpt.CheckpointManager(tmp_path / "run")
    unkeyed.save(4, {"model": model})
    with pytest.raises(ckpt.SignatureError):
        manager.load_latest({"model": fresh})


def _load_forged_rank(path: str) -> str:
    model = make_model(1)
    try:
        ckpt.load({"model": model}, path)
    except ckpt.UnsafeCheckpointError as e:
        return f"{dist.get_rank()}:{e.item}"
    return "loaded"


@pytest.mark.parametrize("world_size", [2])
def test_forged_checkpoint_refused_on_every_rank(tmp_path: Path, world_size: int) -> None:
    path, marker = tmp_path / "c", tmp_path / "ran"
    _saved(path)
    drop_index(path)  # the load reads .metadata only without an index
    forge_metadata(path, marker)
    out = run_ranks(_load_forged_rank, world_size, str(path))
    assert out == [f"{r}:.metadata" for r in range(world_size)]
    assert not marker.exists()


def test_weights_only_object_reader_refuses_reduce() -> None:
    buf = io.BytesIO()
    torch.save({"ok": 1, "bad": Payload(Path("/nonexistent/x"))}, buf)
    buf.seek(0)
    with pytest.raises(ckpt.UnsafeCheckpointError, match="mkdir"):
        safe_unpickling.load_object(buf, Path("."), "k", ())
