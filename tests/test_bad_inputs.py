"""The wrong calls of issue 15's list: each raises a clear error or behaves as documented.

Grouped by package; the distributed ones batch their sub-cases into one
``run_ranks`` call each (a call costs a fork and a rendezvous).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ckpt
import fsdp
import zero_optim
from flatparam import FlatParameter, FlattenParamsWrapper, RankDisagreementError
from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
from fsdp import StateDictType
from fsdp.wrap import ModuleWrapPolicy
from tests.ckpt._common import make_model
from tests.fsdp._common import SEQ, VOCAB, Block, Net
from tests.ranks import run_ranks

# ------------------------------------------------------------------- flatparam


@pytest.mark.parametrize("world_size", [2.5, "2", True])
def test_layout_for_refuses_non_integer_world_sizes(world_size: Any) -> None:
    flat = FlatParameter([nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))])
    with pytest.raises(TypeError, match="world_size must be an integer"):
        flat.layout_for(world_size)
    assert flat.layout_for(2).world_size == 2


def test_flatten_params_wrapper_refuses_a_non_module() -> None:
    with pytest.raises(TypeError, match=r"wraps an nn\.Module, got str"):
        FlattenParamsWrapper("notamodule", [])  # type: ignore[arg-type]


# ------------------------------------------------------------------------ fsdp


def _wrapped(use_orig_params: bool = False, **kw: Any) -> FSDP:
    torch.manual_seed(0)
    policy = ModuleWrapPolicy({Block})
    return FSDP(Net(2), auto_wrap_policy=policy, use_orig_params=use_orig_params, **kw)


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _rank_fsdp_inputs() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for orig in (False, True):
        model = _wrapped(orig)
        with FSDP.summon_full_params(model, writeback=True):
            weight = model.module.head.weight  # type: ignore[union-attr]
            weight.data = torch.full_like(weight, 3.0)  # replaces the storage
        with FSDP.summon_full_params(model):
            out[f"written back (use_orig_params={orig})"] = bool(
                (model.module.head.weight == 3.0).all()  # type: ignore[union-attr]
            )
        try:
            with FSDP.summon_full_params(model, writeback=True):
                model.module.head.weight.data = torch.zeros(2, 2)  # type: ignore[union-attr]
        except ValueError as e:
            out[f"wrong shape (use_orig_params={orig})"] = str(e)
    model = _wrapped()
    model(_batch()).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    for max_norm in (-1.0, float("nan")):
        try:
            model.clip_grad_norm_(max_norm)
        except ValueError as e:
            out[f"clip {max_norm}"] = str(e)
    after = [p.grad for p in model.parameters() if p.grad is not None]
    out["grads untouched"] = all(torch.equal(a, b) for a, b in zip(grads, after, strict=True))
    try:
        _wrapped(process_group="world")
    except ValueError as e:
        out["process_group"] = str(e)
    return out


def test_fsdp_bad_inputs() -> None:
    for out in run_ranks(_rank_fsdp_inputs, 2):
        assert out["written back (use_orig_params=False)"]
        assert out["written back (use_orig_params=True)"]
        for orig in (False, True):
            assert (
                "a parameter's .data was replaced by a tensor of shape (2, 2)"
                in (out[f"wrong shape (use_orig_params={orig})"])
            )
        assert "max_norm must be >= 0" in out["clip -1.0"]
        assert "max_norm must be >= 0" in out["clip nan"]
        assert out["grads untouched"]
        assert "must be a torch.distributed.ProcessGroup, got 'world'" in out["process_group"]


def _rank_cuda_device_id() -> str:
    try:
        _wrapped(device_id=torch.device("cuda:0"))
    except ValueError as e:
        return str(e)
    return "accepted"


def test_fsdp_cuda_device_id_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():  # the message is for machines without CUDA
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    [message] = run_ranks(_rank_cuda_device_id, 1)
    assert "names a CUDA device but CUDA is not available" in message


def test_errors_are_exported_and_shared() -> None:
    assert fsdp.CollectiveError is zero_optim.CollectiveError is ckpt.CollectiveError
    assert issubclass(fsdp.CollectiveError, RuntimeError)
    assert fsdp.RankDisagreementError is RankDisagreementError
    assert issubclass(RankDisagreementError, ValueError)
    assert issubclass(ckpt.CheckpointDisagreementError, ckpt.CheckpointError)
    assert issubclass(ckpt.CheckpointDisagreementError, RankDisagreementError)
    assert issubclass(ckpt.LocalShardMismatchError, ckpt.CheckpointError)
    assert issubclass(ckpt.LocalShardMismatchError, ValueError)  # as before


# ------------------------------------------------------------------ zero_optim


def _rank_zero_inputs() -> dict[str, str]:
    out: dict[str, str] = {}
    # another model's state: refused at load, not at the next step()
    other = make_model(1)
    for p in other.parameters():
        p.data = torch.cat([p.data, p.data])  # same number of parameters, other sizes
    donor = torch.optim.Adam(other.parameters())
    for p in other.parameters():
        p.grad = torch.ones_like(p)
    donor.step()
    model = make_model(0)
    zero = zero_optim.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam)
    try:
        zero.load_state_dict(donor.state_dict())
    except ValueError as e:
        out["other model"] = str(e)
    # ranks that built different models: the same error on every rank, at construction
    width = 4 if dist.get_rank() == 0 else 5
    torch.manual_seed(0)
    try:
        zero_optim.ZeroRedundancyOptimizer(
            nn.Linear(width, 3).parameters(), torch.optim.SGD, lr=0.1
        )
    except RankDisagreementError as e:
        out["disagree"] = str(e)
    return out


def test_zero_optim_bad_inputs() -> None:
    outs = run_ranks(_rank_zero_inputs, 2)
    for out in outs:
        assert "was saved from another model" in out["other model"]
        assert out["disagree"].startswith(
            "ZeroRedundancyOptimizer (construction): the ranks disagree on parameter 0 "
            "(rank 0: (3, 4) float32 on cpu (trainable); rank 1: (3, 5) float32"
        )
    assert outs[0]["disagree"] == outs[1]["disagree"]


# ------------------------------------------------------------------------ ckpt


def test_load_without_the_saved_entry_says_so(tmp_path: Path) -> None:
    model = make_model(0)
    ckpt.save({"model": model}, tmp_path / "c")
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    with pytest.raises(ckpt.StateDictMismatchError) as info:
        ckpt.load({"model": model, "optim": optim}, tmp_path / "c")
    assert "The checkpoint has no 'optim' entry at all" in str(info.value)
    assert "another model" not in str(info.value)


def test_load_into_another_dtype_is_refused(tmp_path: Path) -> None:
    ckpt.save({"model": make_model(0)}, tmp_path / "c")
    model = make_model(1).to(torch.bfloat16)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ckpt.StateDictMismatchError, match="Dtype mismatches") as info:
        ckpt.load({"model": model}, tmp_path / "c")
    assert "checkpoint float32, the state being loaded bfloat16" in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_save_under_a_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="is a file, not a directory"):
        ckpt.save({"model": make_model(0)}, tmp_path / "file" / "c")


def _rank_ckpt_inputs(root: str) -> dict[str, str]:
    rank = dist.get_rank()
    out: dict[str, str] = {}
    model = make_model(0)
    try:
        ckpt.save({"model": model}, Path(root) / f"rank{rank}")
    except ckpt.CheckpointDisagreementError as e:
        out["path"] = str(e)
    ckpt.save({"model": model}, Path(root) / "c")
    try:
        ckpt.save({"model": model}, Path(root) / "c", overwrite=rank == 1)
    except ckpt.CheckpointDisagreementError as e:
        out["overwrite"] = str(e)
    # a LOCAL state dict loaded as a FULL one
    torch.manual_seed(0)
    wrapped = FSDP(Net(2), auto_wrap_policy=ModuleWrapPolicy({Block}))
    with ckpt.state_dict_type(wrapped, StateDictType.LOCAL_STATE_DICT):
        ckpt.save({"model": wrapped}, Path(root) / "local")
    try:
        ckpt.load({"model": wrapped}, Path(root) / "local")
    except ckpt.StateDictMismatchError as e:
        out["local"] = str(e)
    return out


def test_ckpt_bad_inputs_on_ranks(tmp_path: Path) -> None:
    outs = run_ranks(_rank_ckpt_inputs, 2, str(tmp_path))
    for out in outs:
        assert "the ranks disagree on path (rank 0: " in out["path"]
        assert "rank0; rank 1: " in out["path"]
        assert "Pass the same path on every rank" in out["path"]
        assert "disagree on overwrite (rank 0: False; rank 1: True)" in out["overwrite"]
        assert "LOCAL_STATE_DICT" in out["local"]
        assert "another model" not in out["local"]
    assert not (tmp_path / "rank0").exists() and not (tmp_path / "rank1").exists()
