"""``fully_shard([a, b])``: several modules as one group, against torch's ``fully_shard``.

The patterns clients use: torchtitan groups the final norm with the output
projection (``fully_shard([model.norm, model.output])``), a chunked loss runs the
model without its output projection and then calls the projection on each chunk
(the group's pass never completes inside the model's forward), a model whose
embedding is tied to the output projection groups the three, and torchtitan's
``ChunkedCELoss`` keeps the projection gathered across its chunks. Each is trained
for three AdamW steps with torch's ``fully_shard`` and with ours on the same model
and data: losses, full gradients and full parameters are compared after each step,
bit for bit at 1 and 2 ranks, within an ulp at 4 (see ``test_parity.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tests.fsdp._common import VOCAB, Net, batches
from tests.fully_shard._common import assert_parity, compare, step_and_record
from tests.ranks import run_ranks

STEPS = 3
CHUNKS = 3


class GroupNet(Net):
    """``Net`` whose forward can stop before the output projection (a chunked loss
    applies it per chunk), optionally with the projection tied to the embedding."""

    def __init__(self, tied: bool) -> None:
        super().__init__(n_blocks=2)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: Tensor, skip_head: bool = False) -> Tensor:  # type: ignore[override]
        h = self.emb(idx) * self.scale
        for b in self.blocks:
            h = b(h)
        h = self.ln_f(h)
        return h if skip_head else self.head(h)


@dataclasses.dataclass(frozen=True)
class GroupCase:
    """How the modules are grouped and how the loss is computed."""

    tied: bool = False  # head tied to the embedding: [emb, ln_f, head] grouped
    chunked: bool = False  # model(x, skip_head=True), then head(chunk) per chunk
    keep_gathered: bool = False  # ChunkedCELoss: head kept gathered over the chunks
    group_reshard: bool | None = None  # the group's reshard_after_forward
    bf16: bool = False  # MixedPrecisionPolicy(bf16 params, fp32 reduction) everywhere
    accumulate: int = 1  # micro-batches, all but the last without gradient sync
    tolerance_4: float = 1e-5


CASES: dict[str, GroupCase] = {
    "norm_head": GroupCase(),
    "norm_head_kept": GroupCase(group_reshard=False),
    "tied": GroupCase(tied=True),
    "chunked": GroupCase(chunked=True),
    "chunked_kept": GroupCase(chunked=True, group_reshard=False),
    "chunked_tied": GroupCase(chunked=True, tied=True),
    "chunked_keep_gathered": GroupCase(chunked=True, keep_gathered=True),
    "chunked_bf16": GroupCase(chunked=True, bf16=True, tolerance_4=3e-2),
    "chunked_accumulate": GroupCase(chunked=True, accumulate=2),
}


def _build(impl: str, case: GroupCase) -> nn.Module:
    if impl == "torch":
        import torch.distributed.fsdp as api
    else:
        import fsdp as api  # type: ignore[no-redef]
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = GroupNet(case.tied)
    kwargs: dict[str, Any] = {"mesh": init_device_mesh("cpu", (dist.get_world_size(),))}
    if case.bf16:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    group_kwargs = dict(kwargs)
    if case.group_reshard is not None:
        group_kwargs["reshard_after_forward"] = case.group_reshard
    for block in model.blocks:
        api.fully_shard(block, **kwargs)
    if case.tied:
        grouped = api.fully_shard([model.emb, model.ln_f, model.head], **group_kwargs)
    else:
        grouped = api.fully_shard([model.ln_f, model.head], **group_kwargs)
        assert isinstance(grouped, list) and grouped[1] is model.head
    api.fully_shard(model, **kwargs)
    return model


def _chunked_loss(model: Any, x: Tensor, y: Tensor, case: GroupCase) -> float:
    """The model without its projection, then the projection and the loss per chunk of
    the sequence, then the backward through the model with the chunks' input gradients."""
    h = model(x, skip_head=True)
    if case.keep_gathered:
        model.head.set_reshard_after_forward(False)
        model.head.set_reshard_after_backward(False)
    grads = []
    total = 0.0
    tokens = y.numel()
    for piece, yc in zip(h.detach().chunk(CHUNKS, dim=1), y.chunk(CHUNKS, dim=1), strict=True):
        hc = piece.contiguous().requires_grad_(True)
        logits = model.head(hc)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), yc.reshape(-1), reduction="sum")
        (loss / tokens).backward()
        total += loss.item() / tokens
        grads.append(hc.grad)
    if case.keep_gathered:
        model.head.set_reshard_after_forward(True)
        model.head.set_reshard_after_backward(True)
        model.head.reshard()
    h.backward(torch.cat(grads, dim=1))
    return total


def _train(model: Any, case: GroupCase) -> dict[str, list[Any]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = iter(batches(STEPS * case.accumulate))
    record: dict[str, list[Any]] = {"loss": [], "grads": [], "params": []}
    for _ in range(STEPS):
        for micro in range(case.accumulate):
            if case.accumulate > 1:
                model.set_requires_gradient_sync(micro == case.accumulate - 1)
            x, y = next(data)
            if case.chunked:
                record["loss"].append(_chunked_loss(model, x, y, case))
            else:
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
                loss.backward()
                record["loss"].append(loss.item())
        step_and_record(model, opt, record)
    return record


def _rank_compare(names: list[str]) -> dict[str, tuple[bool, float]]:
    out = {}
    for name in names:
        case = CASES[name]
        ref = _train(_build("torch", case), case)
        ours = _train(_build("ours", case), case)
        out[name] = compare(ref, ours)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_grouped_modules_match_torch(world_size: int) -> None:
    names = list(CASES)
    results = run_ranks(_rank_compare, world_size, names, timeout=280)
    assert_parity(results, names, world_size, lambda name: CASES[name].tolerance_4)


def _rank_group_api() -> dict[str, Any]:
    import fsdp

    torch.manual_seed(0)
    model = GroupNet(tied=False)
    for block in model.blocks:
        fsdp.fully_shard(block)
    given = [model.ln_f, model.head, model.ln_f]  # a repeat counts once
    out = fsdp.fully_shard(given)
    fsdp.fully_shard(model)
    state = model.head._fully_shard_state()  # type: ignore[operator]
    x, _ = batches(1)[0]
    model(x).sum().backward()
    head_gathered = []
    model.head.unshard()  # type: ignore[operator]
    head_gathered.append(not isinstance(model.ln_f.weight, torch.distributed.tensor.DTensor))
    model.ln_f.reshard()  # type: ignore[operator]
    head_gathered.append(not isinstance(model.head.weight, torch.distributed.tensor.DTensor))
    return {
        "returns_list": out is given,
        "both_fsdp": all(isinstance(m, fsdp.FSDPModule) for m in (model.ln_f, model.head)),
        "one_state": state is model.ln_f._fully_shard_state(),  # type: ignore[operator]
        "one_group": state.group is not None and len(state.group.params) == 4,
        "grads": all(p.grad is not None for p in model.parameters()),
        "unshard_both_reshard_both": head_gathered,
    }


def test_a_group_is_one_state_gathered_and_freed_together() -> None:
    for result in run_ranks(_rank_group_api, 2):
        assert result == {
            "returns_list": True,
            "both_fsdp": True,
            "one_state": True,
            "one_group": True,
            "grads": True,
            "unshard_both_reshard_both": [True, False],
        }, result
