"""Single-process checks: fsdp without ckpt, chunking, re-keying, type selection."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from torch import nn

import ckpt
from ckpt._wrappers.sharded_chunks import chunk_bounds

_ROOT = Path(__file__).resolve().parents[2]

_WITHOUT_CKPT = """
import sys
sys.modules["ckpt"] = None  # as if ckpt were not installed
import fsdp
from fsdp import FullyShardedDataParallel as FSDP, StateDictType
T = StateDictType
assert "ckpt" not in [m for m in sys.modules if sys.modules[m] is not None]
calls = {
    "set_state_dict_type": lambda: FSDP.set_state_dict_type(None, StateDictType.SHARDED_STATE_DICT),
    "state_dict_type": lambda: FSDP.state_dict_type(None, T.FULL_STATE_DICT).__enter__(),
    "optim_state_dict": lambda: FSDP.optim_state_dict(None, None),
    "rekey_optim_state_dict": lambda: FSDP.rekey_optim_state_dict({}, None, None),
    "scatter_full_optim_state_dict": lambda: FSDP.scatter_full_optim_state_dict(None, None),
}
for name, call in calls.items():
    try:
        call()
    except ImportError as e:
        assert "pip install shardkit-ckpt" in str(e) and name in str(e), (name, str(e))
    else:
        raise AssertionError(name + " did not raise ImportError")
print("ok")
"""


def test_fsdp_imports_and_explains_without_ckpt() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_CKPT],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    deps = tomllib.loads((_ROOT / "packages/fsdp/pyproject.toml").read_text())["project"]
    assert not any("ckpt" in d for d in deps["dependencies"]), deps


@pytest.mark.parametrize("dim0", [0, 1, 3, 4, 5, 13])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_chunk_bounds_match_torch_chunk(dim0: int, world_size: int) -> None:
    chunks = torch.arange(dim0).chunk(world_size) if dim0 else ()
    for rank in range(world_size):
        start, end = chunk_bounds(dim0, world_size, rank)
        want = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, end)) == want, (rank, start, end)


def test_rekey_between_names_and_ids() -> None:
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from fsdp import OptimStateKeyType

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    by_id = optim.state_dict()
    by_name = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, model)
    assert sorted(by_name["state"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert torch.equal(by_name["state"]["1.weight"]["exp_avg"], by_id["state"][2]["exp_avg"])
    back = FSDP.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, model, optim=optim)
    assert sorted(back["state"]) == [0, 1, 2, 3]
    assert back["param_groups"][0]["params"] == [0, 1, 2, 3]
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    fresh.load_state_dict(back)
    assert torch.equal(fresh.state_dict()["state"][2]["exp_avg"], by_id["state"][2]["exp_avg"])
    with pytest.raises(ValueError, match="does not have"):
        by_name["state"]["2.weight"] = by_name["state"]["1.weight"]
        FSDP.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, model)


def test_state_dict_type_of_a_model_without_fsdp() -> None:
    model = nn.Linear(2, 2)
    settings = ckpt.get_state_dict_type(model)
    assert settings.state_dict_type is ckpt.StateDictType.FULL_STATE_DICT
    with ckpt.state_dict_type(model, ckpt.StateDictType.SHARDED_STATE_DICT):
        assert set(model.state_dict()) == {"weight", "bias"}  # nothing to change
    with pytest.raises(TypeError, match=r"must be fsdp\.StateDictType or torch\.distributed"):
        ckpt.set_state_dict_type(model, "SHARDED")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LOCAL_STATE_DICT takes a LocalOptimStateDictConfig"):
        ckpt.set_state_dict_type(
            model,
            ckpt.StateDictType.LOCAL_STATE_DICT,
            ckpt.LocalStateDictConfig(),
            ckpt.FullOptimStateDictConfig(),
        )
