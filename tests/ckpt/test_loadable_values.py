"""State dicts with ``ShardedTensor`` and tensor-like values load as torch's FSDP1 loads them.

Lightning resumes a sharded checkpoint through
``torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict`` (its values
are ``ShardedTensor`` s) and a full one through a lazy loader whose values are
tensor-likes (``torch.overrides.is_tensor_like``, not ``Tensor``). Here torch's own
FSDP1 makes those state dicts, ours loads them, and both continue training: the
losses must be equal, which they are only if every value landed where it belongs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.ckpt._wrappers import LR, train
from tests.fsdp._common import Block, make_net
from tests.ranks import run_ranks


class LazyTensor:
    """A tensor-like that reads its value only when a torch function touches it,
    as Lightning's lazy checkpoint loader does; counts its loads."""

    loads = 0

    def __init__(self, value: Tensor) -> None:
        self._value = value
        self.shape = value.shape
        self.dtype = value.dtype

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def load(a: Any) -> Any:
            if isinstance(a, LazyTensor):
                LazyTensor.loads += 1
                return a._value.clone()
            return a

        return func(*[load(a) for a in args], **(kwargs or {}))


def _lazy(tree: Any) -> Any:
    if isinstance(tree, Tensor):
        return LazyTensor(tree)
    if isinstance(tree, dict):
        return {k: _lazy(v) for k, v in tree.items()}
    return tree


def _torch_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = TorchFSDP(make_net(seed), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id="cpu")
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _our_model(seed: int, use_orig_params: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from fsdp.wrap import ModuleWrapPolicy

    model = FSDP(
        make_net(seed),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id="cpu",
        use_orig_params=use_orig_params,
    )
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _torch_state(kind: str) -> tuple[dict[str, Any], dict[str, Any], list[float]]:
    """torch's FSDP1 after 3 steps: its model and optimizer state dicts, and the losses
    of 3 more steps (the reference for a resumed run)."""
    import torch.distributed.fsdp as tfsdp

    model, optim = _torch_model(0)
    train(model, optim, 0, 3)
    if kind == "sharded":
        # _use_dtensor=False: torch's FSDP1 then gives ShardedTensor values.
        configs: tuple[Any, ...] = (
            tfsdp.StateDictType.SHARDED_STATE_DICT,
            tfsdp.ShardedStateDictConfig(_use_dtensor=False),
            tfsdp.ShardedOptimStateDictConfig(_use_dtensor=False),
        )
    else:
        configs = (
            tfsdp.StateDictType.FULL_STATE_DICT,
            tfsdp.FullStateDictConfig(),
            tfsdp.FullOptimStateDictConfig(rank0_only=False),
        )
    with tfsdp.FullyShardedDataParallel.state_dict_type(model, *configs):
        msd = model.state_dict()
        osd = tfsdp.FullyShardedDataParallel.optim_state_dict(model, optim)
    return msd, osd, train(model, optim, 3, 6)


def _load_rank(kind: str, use_orig_params: bool) -> dict[str, Any]:
    import torch.distributed.fsdp as tfsdp
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    msd, osd, expected = _torch_state(kind)
    values = [v for v in msd.values() if isinstance(v, Tensor)]
    optim_values = [v for s in osd["state"].values() for v in s.values()]
    if kind == "sharded":
        sharded = [v for v in [*values, *optim_values] if isinstance(v, ShardedTensor)]
        assert len(sharded) >= len(values) - 1  # every parameter (the buffer is plain)
        configs: tuple[Any, ...] = (
            tfsdp.StateDictType.SHARDED_STATE_DICT,
            tfsdp.ShardedStateDictConfig(),
            tfsdp.ShardedOptimStateDictConfig(),
        )
    else:
        msd, osd = _lazy(msd), _lazy(osd)
        configs = (tfsdp.StateDictType.FULL_STATE_DICT, tfsdp.FullStateDictConfig(), None)
    model, optim = _our_model(1, use_orig_params)
    LazyTensor.loads = 0
    seen: list[int] = []  # loads so far, as each unit has loaded its entries
    for unit in FSDP.fsdp_modules(model):
        unit.register_load_state_dict_pre_hook(lambda *a: seen.append(LazyTensor.loads))
    with FSDP.state_dict_type(model, *configs):
        model.load_state_dict(msd)
        unit_loads = list(seen)
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd))
    loads = LazyTensor.loads
    return {
        "losses": train(model, optim, 3, 6),
        "expected": expected,
        "loads": loads,
        "unit_loads": unit_loads,
    }


@pytest.mark.parametrize("kind", ["sharded", "lazy-full"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_torch_state_dicts_load_and_resume(kind: str, use_orig_params: bool) -> None:
    for out in run_ranks(_load_rank, 2, kind, use_orig_params, timeout=120):
        assert out["losses"] == out["expected"], out
        if kind == "lazy-full":
            # Lazily, unit by unit: as each of the 4 units (root, 3 blocks) starts
            # loading, only earlier units' values have been read (18 in all).
            seen = out["unit_loads"]
            assert len(seen) == 4 and seen == sorted(set(seen)), out
            assert seen[0] == 0 and seen[-1] < 18, out
            assert out["loads"] > 18, out  # then the optimizer state


def _other_layout_rank() -> bool:
    """A ShardedTensor not chunked as torch.chunk would chunk it (rank 0 holds the tail)
    is assembled by a collective and loads all the same."""
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    from torch.distributed._shard.sharding_spec import ShardMetadata

    import fsdp
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = make_net(7)
    full = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    sd: dict[str, Any] = {}
    for key, value in full.items():
        if value.dim() == 0 or value.shape[0] < world:
            sd[key] = value
            continue
        # Rows split in two, rank 0 holding the second part, rank 1 the first.
        cut = value.shape[0] // 2
        start, end = (cut, value.shape[0]) if rank == 0 else (0, cut)
        meta = ShardMetadata(
            shard_offsets=[start] + [0] * (value.dim() - 1),
            shard_sizes=[end - start, *value.shape[1:]],
            placement=f"rank:{rank}/cpu",
        )
        sd[key] = init_from_local_shards([Shard(value[start:end].clone(), meta)], *value.shape)
    model, _ = _our_model(1, False)
    with FSDP.state_dict_type(model, fsdp.StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(sd)
    with FSDP.summon_full_params(model):
        got = dict(model.named_parameters())
    return all(torch.equal(got[k], full[k]) for k in got)


def test_sharded_tensor_in_another_layout_loads() -> None:
    assert run_ranks(_other_layout_rank, 2) == [True, True]
