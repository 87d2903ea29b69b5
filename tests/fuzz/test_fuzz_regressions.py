"""The fuzzer's findings, each kept as the minimal example that showed it.

Each was a silent wrong result (ours trained differently from DDP with no
error) or an error nobody could act on, until the fix named beside it.
"""

from __future__ import annotations

import pytest

from tests.fuzz._run import check_example
from tests.fuzz._space import Example, FullyShardPlan, Micro, ModelSpec, Step

_TINY = ModelSpec(dim=1, widths=(1,))
_ROOT_ONLY = FullyShardPlan(calls=(("",),), reshard_after_forward=(True,))

FOUND: dict[str, Example] = {
    # set_is_last_backward(False) before the step's only backward: the reductions were left
    # in flight, so the optimizer stepped without (or with last step's) gradients. Now
    # every backward completes its reductions (_fully_shard/_state.py, _finalize_backward).
    "not_last_backward_then_step": Example(
        world_size=2,
        model=_TINY,
        plan=_ROOT_ONLY,
        steps=(Step(), Step(), Step(micros=(Micro(last_backward=False),))),
    ),
    # set_unshard_in_backward(False) on a LayerNorm, whose backward reads its weight: the
    # backward read freed storage ("data is not allocated yet", from C++). Now the forward
    # notes that autograd saved the parameters and the pre-backward raises a ValueError
    # naming the module (_fully_shard/_saved_params.py).
    "unshard_in_backward_on_a_norm": Example(
        world_size=2,
        model=_TINY,
        plan=FullyShardPlan(calls=(("ln_f",), ("",)), reshard_after_forward=(True, True)),
        steps=(Step(), Step(settings=(("ln_f", "set_unshard_in_backward", False),))),
    ),
    # A backward prefetch of a module whose backward already ran (issue 32's report; see
    # tests/fully_shard/test_misprefetch.py): the gather stayed and the next forward used
    # it, stale after the optimizer step.
    "backward_misprefetch": Example(
        world_size=2,
        model=ModelSpec(dim=3, widths=(4, 2)),
        plan=FullyShardPlan(
            calls=(("blocks.0",), ("blocks.1",), ("",)), reshard_after_forward=(True, True, None)
        ),
        steps=(Step(settings=(("blocks.0", "set_modules_to_backward_prefetch", ("blocks.1",)),)),)
        * 3,
    ),
    # set_reshard_after_backward(False) with reshard_after_forward=False: the gathered
    # parameters outlived the optimizer step ([Note: stale gathers]).
    "kept_gathered_across_step": Example(
        world_size=2,
        model=_TINY,
        plan=FullyShardPlan(calls=(("blocks.0",), ("",)), reshard_after_forward=(False, True)),
        steps=(
            Step(
                settings=(
                    ("blocks.0", "set_reshard_after_backward", False),
                    ("", "set_reshard_after_backward", False),
                )
            ),
        )
        * 3,
    ),
    # HSDP, set_requires_all_reduce(False) on two backwards before one with it: the second
    # took the first's partial sums along and dropped them (only a final reduction adds
    # them), so the step lost a micro-batch's gradient. Found by the long run.
    "two_backwards_without_all_reduce": Example(
        world_size=4,
        model=_TINY,
        plan=FullyShardPlan(calls=(("",),), reshard_after_forward=(True,), hsdp=True),
        steps=(
            Step(),
            Step(micros=(Micro(all_reduce=False), Micro(all_reduce=False), Micro())),
            Step(),
        ),
    ),
    # Sharded across replicas, unshard() by hand after backward: it gathered the replica
    # shards again (the reduction had dropped them) before the optimizer step, and the next
    # forward used them, stale. Now they follow the version counter the stale gathers
    # follow ([Note: sharding across replicas] in fsdp/_runtime/_replica_shard.py).
    "across_replicas_unshard_after_backward": Example(
        world_size=4,
        model=_TINY,
        plan=FullyShardPlan(calls=(("",),), reshard_after_forward=(True,), hsdp=True, across=True),
        steps=(Step(), Step(calls=(("after_backward", "", "unshard"),)), Step()),
    ),
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_found_by_fuzzer(name: str) -> None:
    check_example(FOUND[name])
