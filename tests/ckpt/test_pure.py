"""The pure parts of ckpt, in one process: file assignment, manifests, key fitting."""

from __future__ import annotations

import pickle
import zlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckpt import CorruptCheckpointError, FileProblem, ShapeMismatch, StateDictMismatchError
from ckpt._commit.load_fit import combine_fits, fit_rank
from ckpt._format.file_checks import check_file_set, verify_files
from ckpt._format.manifest import (
    Checksum,
    Manifest,
    balance_files,
    file_owner,
    hash_file,
    new_manifest,
    read_manifest,
    write_manifest,
)

# ---------------------------------------------------------------- file assignment


@given(
    st.dictionaries(st.text(min_size=1, max_size=8), st.integers(0, 10**9), max_size=30),
    st.integers(1, 9),
)
def test_balance_files_assigns_each_file_once_and_evenly(sizes: dict[str, int], world: int) -> None:
    parts = balance_files(sizes, world)
    assert len(parts) == world
    flat = [n for part in parts for n in part]
    assert sorted(flat) == sorted(sizes)
    assert parts == balance_files(dict(reversed(list(sizes.items()))), world)  # order-free
    loads = [sum(sizes[n] for n in part) for part in parts]
    # Greedy largest-first: no rank exceeds the lightest by more than the largest file.
    assert max(loads) - min(loads) <= max(sizes.values(), default=0)


def test_balance_files_rejects_empty_world() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        balance_files({"a": 1}, 0)


def test_file_owner_follows_dcp_rank_prefix() -> None:
    assert file_owner("__0_0.distcp", 4) == 0
    assert file_owner("__3_1.distcp", 4) == 3
    assert file_owner("__13_0.distcp", 16) == 13
    assert file_owner(".metadata", 4) == 0
    assert file_owner("__7_0.distcp", 4) == 0  # a rank that does not exist: coordinator


# ---------------------------------------------------------------- manifests


@pytest.mark.parametrize("checksum", list(Checksum))
def test_hash_file_matches_reference_and_manifest_round_trips(
    tmp_path: Path, checksum: Checksum
) -> None:
    data = bytes(range(256)) * 40_000  # 10 MB: more than one read chunk
    (tmp_path / "a.bin").write_bytes(data)
    rec = hash_file(tmp_path / "a.bin", checksum)
    assert rec.size == len(data)
    if checksum is Checksum.CRC32:
        assert rec.digest == f"{zlib.crc32(data):08x}"
    else:
        import hashlib

        assert rec.digest == hashlib.blake2b(data, digest_size=32).hexdigest()
    manifest = new_manifest([rec], checksum, world_size=3)
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path) == manifest
    assert manifest.total_bytes == len(data)


def _setup(tmp_path: Path) -> Manifest:
    for name, data in {"__0_0.distcp": b"x" * 1000, "__1_0.distcp": b"y" * 500}.items():
        (tmp_path / name).write_bytes(data)
    recs = [hash_file(tmp_path / n, Checksum.CRC32) for n in ("__0_0.distcp", "__1_0.distcp")]
    return new_manifest(recs, Checksum.CRC32, world_size=2)


def test_verify_files_finds_each_kind_of_damage(tmp_path: Path) -> None:
    manifest = _setup(tmp_path)
    names = ["__0_0.distcp", "__1_0.distcp"]
    assert verify_files(tmp_path, manifest, names) == []
    assert check_file_set(manifest, names) == []

    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 999)  # truncated
    data = bytearray(b"y" * 500)
    data[250] ^= 0x01  # one flipped bit, same size
    (tmp_path / "__1_0.distcp").write_bytes(bytes(data))
    problems = verify_files(tmp_path, manifest, names)
    assert [(p.name, p.kind) for p in problems] == [
        ("__0_0.distcp", "size"),
        ("__1_0.distcp", "checksum"),
    ]
    assert "truncated: 999 bytes on disk, manifest says 1000" in str(problems[0])

    (tmp_path / "__0_0.distcp").unlink()
    (tmp_path / "stray.bin").write_bytes(b"")
    present = ["__1_0.distcp", "stray.bin"]
    assert check_file_set(manifest, present) == [
        FileProblem("__0_0.distcp", "missing", "listed in the manifest but not on disk"),
        FileProblem("stray.bin", "unexpected", "on disk but not in the manifest"),
    ]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "not valid JSON"),
        ('{"format": "other"}', "not a ckpt-manifest document"),
        ('{"format": "ckpt-manifest", "version": 99}', "manifest version 99"),
        ('{"format": "ckpt-manifest", "version": 1, "files": []}', "malformed field"),
    ],
)
def test_a_damaged_manifest_is_reported_as_corruption(
    tmp_path: Path, text: str, match: str
) -> None:
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        Manifest.from_json(text, tmp_path)
    assert info.value.problems[0].name == "ckpt-manifest.json"


# ---------------------------------------------------------------- fitting keys


def test_fit_reports_missing_unexpected_shapes_and_kinds() -> None:
    saved = {"model.w": (4, 2), "model.b": (4,), "model.old": (1,), "step": None, "other.x": (1,)}
    local = {"model.w": (4, 3), "model.b": None, "model.new": (2,), "step": None}
    fit = fit_rank(local, saved, entries=["model", "step"])
    assert fit.missing == ("model.new",)
    assert fit.not_needed == {"model.old"}  # "other.x" is not under a loaded entry
    assert fit.shape_mismatches == (ShapeMismatch("model.w", (4, 2), (4, 3)),)
    assert fit.kind_mismatches == ("model.b",)
    error = combine_fits(Path("/c"), [fit], strict=True)
    assert isinstance(error, StateDictMismatchError)
    text = str(error)
    assert "Missing from the checkpoint (1): model.new" in text
    assert "Unexpected in the checkpoint (1): model.old" in text
    assert "model.w: checkpoint has shape [4, 2], the state being loaded has [4, 3]" in text
    # Non-strict forgives keys, never shapes.
    loose = combine_fits(Path("/c"), [fit], strict=False)
    assert loose is not None and loose.missing == () and loose.shape_mismatches


def test_unexpected_means_no_rank_needs_it() -> None:
    # A state sharded by key (ZeRO-style): each rank loads half of the optimizer keys.
    saved: dict[str, tuple[int, ...] | None] = {"opt.a": (2,), "opt.b": (2,), "opt.c": (2,)}
    rank0 = fit_rank({"opt.a": (2,)}, saved, ["opt"])
    rank1 = fit_rank({"opt.b": (2,)}, saved, ["opt"])
    error = combine_fits(Path("/c"), [rank0, rank1], strict=True)
    assert error is not None and error.unexpected == ("opt.c",) and error.missing == ()
    both = fit_rank({"opt.c": (2,)}, saved, ["opt"])
    assert combine_fits(Path("/c"), [rank0, rank1, both], strict=True) is None


def test_another_model_is_called_out() -> None:
    saved = {f"model.enc.{i}": (3,) for i in range(10)}
    local = {f"model.dec.{i}": (3,) for i in range(10)} | {"model.enc.0": (3,)}
    error = combine_fits(Path("/c"), [fit_rank(local, saved, ["model"])], strict=True)
    assert error is not None and error.other_model
    assert "looks like a checkpoint of another model" in str(error)
    assert "and 0 more" not in str(error)


def test_errors_pickle_with_their_details() -> None:
    err = StateDictMismatchError(
        Path("/c"), missing=["a"], shape_mismatches=[ShapeMismatch("w", (1,), (2,))]
    )
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.shape_mismatches == err.shape_mismatches
    corrupt = CorruptCheckpointError(Path("/c"), [FileProblem("f", "size", "d")])
    assert pickle.loads(pickle.dumps(corrupt)).problems == corrupt.problems
