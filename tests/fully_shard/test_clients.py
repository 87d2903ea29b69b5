"""fully_shard as client code meets it: through torch's names, compiled, and when ranks go wrong.

- Code written for torch's FSDP2 (imports from ``torch.distributed.fsdp`` and the
  older ``torch.distributed._composable.fsdp``) runs on ours after
  ``fsdp.torch_compat.install()`` and trains bit for bit as ours imported directly.
- Blocks compiled with ``torch.compile`` before ``fully_shard`` (per-block
  compilation, torchtitan's way) train as eager ones: our hooks run eagerly and
  the blocks' computation compiles.
- Ranks that built different models get one named error at the first forward
  instead of collectives of different sizes; a collective that fails inside
  fully_shard names the rank, the module and the phase.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.fsdp._common import batches, loss_fn
from tests.fully_shard._common import TinyNet, full
from tests.ranks import RankFailure, run_ranks


def _train(model: nn.Module, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in batches(steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [full(p) for p in model.parameters()]


def _torch_names_rank() -> dict[str, Any]:
    import fsdp
    import fsdp.torch_compat

    torch.manual_seed(0)
    direct = TinyNet()
    for block in direct.blocks:
        fsdp.fully_shard(block, mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fsdp.fully_shard(direct, mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    want = _train(direct)
    fsdp.torch_compat.install()
    try:
        # What a client written for torch's FSDP2 does.
        from torch.distributed._composable.fsdp import fully_shard as composable_fully_shard
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        ours = fully_shard is fsdp.fully_shard and composable_fully_shard is fsdp.fully_shard
        torch.manual_seed(0)
        model = TinyNet()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for block in model.blocks:
            composable_fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        is_module = isinstance(model, FSDPModule)
        got = _train(model)
    finally:
        fsdp.torch_compat.uninstall()
    import torch.distributed._composable.fsdp as composable
    import torch.distributed.fsdp as torch_fsdp

    # Every name torch's again, also in modules install() itself imported first.
    restored = (
        torch_fsdp.fully_shard is not fsdp.fully_shard
        and composable.FSDPModule is torch_fsdp.FSDPModule
        and composable.fully_shard is torch_fsdp.fully_shard
    )
    same = want[0] == got[0] and all(
        torch.equal(a, b) for a, b in zip(want[1], got[1], strict=True)
    )
    return {"ours": ours, "is_module": is_module, "same": same, "restored": restored}


def test_code_written_for_torchs_fsdp2_runs_on_ours_after_install() -> None:
    for r in run_ranks(_torch_names_rank, 2):
        assert r == {"ours": True, "is_module": True, "same": True, "restored": True}


def _compile_rank() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    import fsdp

    def build(compiled: bool) -> nn.Module:
        torch.manual_seed(0)
        model = TinyNet()
        for block in model.blocks:
            if compiled:
                block.compile()
            fsdp.fully_shard(block)
        fsdp.fully_shard(model)
        return model

    eager_losses, eager_params = _train(build(False))
    torch._dynamo.reset()
    losses, params = _train(build(True))
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, eager_losses, strict=True)),
        "param": max((a - b).abs().max().item() for a, b in zip(params, eager_params, strict=True)),
        "graphs": counters["stats"]["unique_graphs"],
    }


def test_per_block_compile_trains_like_eager() -> None:
    for r in run_ranks(_compile_rank, 2, timeout=300):
        assert r["graphs"] >= 1, r  # something compiled
        assert r["loss"] <= 1e-5 and r["param"] <= 1e-5, r  # inductor may fuse differently


def _disagree_rank() -> str:
    import fsdp

    torch.manual_seed(0)
    model = TinyNet()
    if dist.get_rank() == 1:
        model.head = nn.Linear(6, 13, bias=False)  # a different model on rank 1
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    try:
        model(torch.zeros(1, 5, dtype=torch.long))
    except fsdp.RankDisagreementError as e:
        return str(e)
    return "no error"


def test_ranks_that_built_different_models_get_one_named_error() -> None:
    for message in run_ranks(_disagree_rank, 2):
        assert message.startswith("fully_shard (first forward, lazy initialisation): the ranks")
        assert "rank 0:" in message and "rank 1:" in message
        assert "head.bias" in message


def _dead_peer_rank(result_file: str) -> str:
    import fsdp

    torch.manual_seed(0)
    model = TinyNet()
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    x, y = batches(1)[0]
    loss_fn(model(x), y).backward()  # lazy init and one step on both ranks
    if dist.get_rank() == 1:
        model.blocks[1].register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
    try:
        loss_fn(model(x), y).backward()
        message = "no error"
    except fsdp.CollectiveError as e:
        message = str(e)
    Path(result_file).write_text(message)  # rank 0's; RankFailure carries no results
    return message


def test_a_dead_peer_is_named_with_the_rank_module_and_phase(tmp_path: Path) -> None:
    result = tmp_path / "rank0.txt"
    with pytest.raises(RankFailure) as info:
        run_ranks(_dead_peer_rank, 2, str(result), timeout=60)
    assert set(info.value.failures) == {1}  # rank 1 died, rank 0 returned
    first = result.read_text().splitlines()[0]
    assert first.startswith("rank 0: "), first
    assert "for FSDP unit 'blocks." in first, first
    # Where rank 0 was when rank 1 died: its next forward, or still finishing the first
    # backward (rank 1 may have sent its last bytes and moved on before rank 0 read them).
    phases = ("forward", "backward", "post-backward")
    assert any(f"failed during {p}: a peer rank died" in first for p in phases), first
