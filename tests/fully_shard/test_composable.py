"""Our ``fully_shard`` seen by torch's composable APIs ([Note: torch's composable registry]).

torch's ``replicate()`` (both: over DDP, and ``replicate_with_fsdp``'s over torch's
FSDP2 runtime) over a model whose blocks ``fully_shard`` sharded must
leave the blocks' (sharded) parameters to ``fully_shard`` and replicate the
rest with DDP. It finds them through torch's composable registry; were ours not
registered there, ``replicate`` would also all-reduce the blocks' local shards
(a wrong result with no error). Trained three AdamW steps against torch's
``replicate`` + torch's ``fully_shard`` on the same model and data: losses, every
full gradient and every full parameter, bit for bit at 2 ranks, within an ulp
at 4 (see ``test_parity.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.fsdp._common import Net, batches
from tests.fully_shard._common import assert_parity, compare, train_plain
from tests.ranks import run_ranks


def _build(impl: str, replicate_api: str = "ddp") -> nn.Module:
    """``Net`` with each block sharded by ``impl``'s fully_shard and the model replicated by
    torch's ``replicate`` (``"ddp"``: ``torch.distributed._composable.replicate``, over DDP;
    ``"fsdp"``: ``replicate_with_fsdp.replicate``, over torch's FSDP2 runtime)."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp import fully_shard  # type: ignore[assignment]
    if replicate_api == "ddp":
        from torch.distributed._composable import replicate
    else:
        from torch.distributed._composable.replicate_with_fsdp import (  # type: ignore[assignment]
            replicate,
        )

    torch.manual_seed(0)
    model = Net(n_blocks=3)
    for block in model.blocks:
        fully_shard(block)
    replicate(model)
    return model


def _registry_rank() -> list[str]:
    """What torch's composable APIs see of a model ours sharded."""
    from torch.distributed._composable import replicate
    from torch.distributed._composable.replicate import _is_fully_sharded
    from torch.distributed._composable_state import _get_module_state

    import fsdp
    from fsdp._fully_shard._state import state_of

    model = _build("ours")
    block = model.blocks[0]  # type: ignore[index]
    assert _is_fully_sharded(block) and not _is_fully_sharded(model)
    assert _get_module_state(block) is state_of(block)
    model(batches(1)[0][0]).sum().backward()  # replicate's lazy init collects its parameters
    names = replicate.state(model)._param_names
    with pytest.raises(AssertionError, match="can only be applied to a module once"):
        fsdp.fully_shard(block)
    return list(names)


def _parity_rank(replicate_api: str) -> dict[str, tuple[bool, float]]:
    ref = train_plain(_build("torch", replicate_api))
    ours = train_plain(_build("ours", replicate_api))
    return {"replicate_over_fully_shard": compare(ref, ours)}


def test_replicate_skips_our_sharded_parameters() -> None:
    names = run_ranks(_registry_rank, 2)
    expected = ["emb.weight", "ln_f.weight", "ln_f.bias", "head.weight", "head.bias"]
    assert names == [expected, expected]


@pytest.mark.parametrize(("replicate_api", "world_size"), [("ddp", 2), ("ddp", 4), ("fsdp", 2)])
def test_replicate_over_fully_shard_matches_torch(replicate_api: str, world_size: int) -> None:
    results = run_ranks(_parity_rank, world_size, replicate_api, timeout=120)
    assert_parity(results, ["replicate_over_fully_shard"], world_size, lambda _: 1e-5)
