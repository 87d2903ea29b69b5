"""The public surface: every error path with its message, and the behaviours around it.

Errors that need no process group run in this process (the argument checks run
before the optimizer touches torch.distributed). The rest, and the behaviours
(add_param_group, trainability changes, partition views, hooks), share one
2-rank spawn.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from tests.ranks import run_ranks
from tests.zero_optim._common import assert_same, batch, make_model
from zero_optim import (
    ZeroRedundancyOptimizer,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    hook_with_zero_step_to_owners,
)

SGD = torch.optim.SGD


# ------------------------------------------------------- no process group needed


def test_params_must_be_an_iterable_of_tensors_or_groups() -> None:
    with pytest.raises(TypeError, match=r"got a single torch.FloatTensor: pass \[tensor\]"):
        ZeroRedundancyOptimizer(torch.zeros(3), SGD, lr=0.1)
    with pytest.raises(
        TypeError, match="iterable of Tensors or of parameter-group dicts, but got int"
    ):
        ZeroRedundancyOptimizer(3, SGD, lr=0.1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"not a mix \(got \['Tensor', 'dict'\]\)"):
        ZeroRedundancyOptimizer([torch.zeros(1), {"params": []}], SGD, lr=0.1)  # type: ignore[list-item]


def test_no_parameters() -> None:
    with pytest.raises(ValueError, match="got an empty parameter list"):
        ZeroRedundancyOptimizer([], SGD, lr=0.1)
    with pytest.raises(ValueError, match="got an empty parameter list"):
        ZeroRedundancyOptimizer(iter([]), SGD, lr=0.1)
    with pytest.raises(ValueError, match="got an empty parameter list"):
        ZeroRedundancyOptimizer([{"params": []}], SGD, lr=0.1)


def test_group_without_params() -> None:
    with pytest.raises(ValueError, match="parameter group 1 has no 'params' key"):
        ZeroRedundancyOptimizer([{"params": [torch.zeros(1)]}, {"lr": 0.1}], SGD, lr=0.1)


def test_sparse_or_mixed_dense_types() -> None:
    sparse = torch.zeros(2, 2).to_sparse()
    with pytest.raises(ValueError, match=r"needs dense parameters, but got a torch.sparse_coo"):
        ZeroRedundancyOptimizer([torch.zeros(1), sparse], SGD, lr=0.1)
    with pytest.raises(
        ValueError, match=r"one dense type, but got both torch\.FloatTensor and torch\.DoubleTensor"
    ):
        ZeroRedundancyOptimizer([torch.zeros(1), torch.zeros(1, dtype=torch.float64)], SGD, lr=0.1)


def test_optimizer_class_must_fit() -> None:
    p = [torch.zeros(1, requires_grad=True)]
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.Optimizer subclass"):
        ZeroRedundancyOptimizer(p, optimizer_class=object, lr=0.1)  # type: ignore[arg-type]
    from torch.distributed.optim.functional_adam import _FunctionalAdam

    with pytest.raises(TypeError, match=r"pass the torch\.optim class"):
        ZeroRedundancyOptimizer(p, _FunctionalAdam, overlap_with_ddp=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="LBFGS cannot be used with overlap_with_ddp=True"):
        ZeroRedundancyOptimizer(p, torch.optim.LBFGS, overlap_with_ddp=True)
    with pytest.raises(ValueError, match="SparseAdam cannot be used with overlap_with_ddp=True"):
        ZeroRedundancyOptimizer(p, torch.optim.SparseAdam, overlap_with_ddp=True)


def test_needs_an_initialised_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"call torch.distributed.init_process_group"):
        ZeroRedundancyOptimizer([torch.zeros(1)], SGD, lr=0.1)


# ------------------------------------------------------------ on two ranks


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, ddp: DDP) -> None:
    for step in steps:
        x, y = batch(step, dist.get_rank())
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()


def _errors_with_a_process_group() -> None:
    params = list(make_model().parameters())
    zero = ZeroRedundancyOptimizer(params, SGD, lr=0.1)

    with pytest.raises(TypeError, match=r"SGD rejected the keyword arguments \['bogus', 'lr'\]"):
        ZeroRedundancyOptimizer(params, SGD, lr=0.1, bogus=1)
    with pytest.raises(RuntimeError, match=r"call consolidate_state_dict\(to=\d\) on all ranks"):
        zero.state_dict()
    with pytest.raises(ValueError, match=r"`to` must be a rank of the process group, 0..1"):
        zero.consolidate_state_dict(to=2)
    with pytest.raises(ValueError, match="a parameter group must have a 'params' key"):
        zero.add_param_group({"lr": 0.1})
    with pytest.raises(ValueError, match="one dense type, but got both"):
        zero.add_param_group({"params": [torch.zeros(2, dtype=torch.float64)]})
    assert len(zero.param_groups) == 1  # the refused group left no trace

    full = {"state": {}, "param_groups": [{"lr": 0.1, "params": list(range(len(params)))}]}
    zero2 = ZeroRedundancyOptimizer(list(make_model().parameters()), SGD, lr=0.1)
    zero2.load_state_dict(full)
    with pytest.raises(ValueError, match="has 2 parameter groups but this optimizer has 1"):
        zero2.load_state_dict({**full, "param_groups": full["param_groups"] * 2})
    with pytest.raises(ValueError, match="group 0 of the state dict has 3 parameters"):
        zero2.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1, 2]}]})
    with pytest.raises(NotImplementedError, match="manual partition"):
        zero2._partition_parameters([[p] for p in params[:2]])

    # The hooks: a non-overlapping optimizer, twice on one optimizer, foreign parameters.
    model = make_model()
    ddp = DDP(model)
    with pytest.raises(ValueError, match="must be constructed with overlap_with_ddp=True"):
        hook_with_zero_step(allreduce_hook, ddp, ZeroRedundancyOptimizer(model.parameters(), SGD))
    stranger = ZeroRedundancyOptimizer(make_model().parameters(), SGD, overlap_with_ddp=True)
    with pytest.raises(ValueError, match=r"does not hold DDP's trainable parameters \['0.weight'"):
        hook_with_zero_step_interleaved(allreduce_hook, ddp, stranger)
    overlapping = ZeroRedundancyOptimizer(model.parameters(), SGD, overlap_with_ddp=True, lr=0.1)
    with pytest.raises(RuntimeError, match="no hook drives it: register one"):
        overlapping.step()
    with pytest.raises(RuntimeError, match="Join with uneven inputs is not supported"):
        Join([ddp, overlapping])
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, overlapping))
    with pytest.raises(RuntimeError, match="a DDP hook already drives this"):
        hook_with_zero_step(allreduce_hook, ddp, overlapping)
    with pytest.raises(RuntimeError, match="a DDP hook already drives this"):
        hook_with_zero_step_to_owners(ddp, overlapping)
    with pytest.raises(ValueError, match="must be constructed with overlap_with_ddp=True"):
        hook_with_zero_step_to_owners(ddp, ZeroRedundancyOptimizer(model.parameters(), SGD))
    with pytest.raises(ValueError, match=r"does not hold DDP's trainable parameters"):
        hook_with_zero_step_to_owners(ddp, stranger)
    with pytest.raises(TypeError, match=r"must be a zero_optim\.ZeroRedundancyOptimizer"):
        hook_with_zero_step(allreduce_hook, ddp, TorchZeRO(model.parameters(), SGD))  # type: ignore[arg-type]


def _warns_once_when_step_is_called_with_a_hook(caplog_records: list[str]) -> None:
    model = make_model()
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(model.parameters(), SGD, overlap_with_ddp=True, lr=0.1)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    reference = make_model()
    ref_ddp = DDP(reference)
    ref_opt = SGD(reference.parameters(), lr=0.1)
    handler = logging.Handler()
    handler.emit = lambda record: caplog_records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zero_optim._optimizer").addHandler(handler)
    _train(model, zero, range(3), ddp)  # calls zero.step(), which must not step again
    _train(reference, ref_opt, range(3), ref_ddp)
    assert_same(list(model.parameters()), list(reference.parameters()), "step() is a no-op")
    assert sum("step() does nothing" in m for m in caplog_records) == 1, caplog_records


def _add_param_group_and_freezing() -> None:
    """add_param_group mid-training and a parameter frozen mid-training, vs plain."""
    results = []
    for kind in ("plain", "ours", "ours_buckets"):
        model = make_model()
        ddp = DDP(model, find_unused_parameters=True)
        head = list(model[4].parameters())
        body = [p for p in model.parameters() if all(p is not h for h in head)]
        opt: Any
        if kind == "plain":
            opt = torch.optim.Adam(body, lr=0.01)
        else:
            opt = ZeroRedundancyOptimizer(
                body, torch.optim.Adam, parameters_as_bucket_view=kind == "ours_buckets", lr=0.01
            )
        before = [p.data_ptr() for p in model.parameters()]
        _train(model, opt, range(3), ddp)
        opt.add_param_group({"params": head, "lr": 0.02})
        _train(model, opt, range(3, 6), ddp)
        model[0].bias.requires_grad_(False)
        model[0].bias.grad = None
        _train(model, opt, range(6, 9), ddp)
        results.append([p.detach().clone() for p in model.parameters()])
        if isinstance(opt, ZeroRedundancyOptimizer):
            assert len(opt.optim.param_groups) == 2
            assert opt.param_groups[1]["lr"] == 0.02
            assert set(opt.param_to_rank) == set(model.parameters())
            if kind == "ours":  # without bucket views .data is never replaced
                assert before == [p.data_ptr() for p in model.parameters()]
    assert_same(results[1], results[0], "ours vs plain")
    assert_same(results[2], results[0], "ours with bucket views vs plain")


def _bucket_views_survive_steps() -> None:
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), SGD, parameters_as_bucket_view=True, lr=0.1)
    buckets = zero._buckets.buckets[torch.device("cpu")]
    ddp = DDP(model)
    _train(model, zero, range(2), ddp)
    for rank, params in enumerate(zero.params_per_rank):
        bucket = buckets[rank]
        assert bucket is not None
        offset = 0
        for p in params:
            # still a view of the rank's bucket, at its packed offset
            assert p.data_ptr() == bucket.data_ptr() + offset * p.element_size()
            assert torch.equal(p.detach().reshape(-1), bucket[offset : offset + p.numel()])
            offset += p.numel()
        assert offset == bucket.numel()


def _partition_views_match_torch() -> None:
    model = make_model()
    params = list(model.parameters())
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": 0.5}]
    ours = ZeroRedundancyOptimizer(groups, SGD, lr=0.1)
    theirs = TorchZeRO(groups, SGD, lr=0.1)
    assert dict(ours.param_to_rank) == theirs._param_to_rank
    assert ours._param_to_rank == theirs._param_to_rank
    assert ours._index_to_param == theirs._index_to_param
    assert ours._param_to_index == theirs._param_to_index
    ours_parts = ours._partition_parameters()
    theirs_parts = theirs._partition_parameters()
    for mine, other in zip(ours_parts, theirs_parts, strict=True):
        assert [g["params"] for g in mine] == [g["params"] for g in other]
    rank = dist.get_rank()
    assert list(ours.params_per_rank[rank]) == [
        p for g in ours.optim.param_groups for p in g["params"]
    ]
    assert ours.partition.numel_per_rank == tuple(
        sum(p.numel() for p in ps) for ps in ours.params_per_rank
    )
    assert ours.join_device == torch.device("cpu")
    assert ours.join_process_group is dist.group.WORLD


def _copying_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """A comm hook whose result is a new tensor, not the bucket's buffer.

    Unannotated: DDP rejects the string annotations ``from __future__`` makes.
    """
    averaged = bucket.buffer() / dist.get_world_size()
    fut = dist.all_reduce(averaged, async_op=True).get_future()  # type: ignore[union-attr]
    return fut.then(lambda f: f.value()[0])


def _overlap_with_other_ddp_settings() -> None:
    """Hooks returning a new tensor, and DDP's gradient_as_bucket_view: still equal to plain."""
    for comm_hook, as_view in ((_copying_allreduce_hook, False), (allreduce_hook, True)):
        results = []
        for kind in ("plain", "ours"):
            model = make_model()
            ddp = DDP(model, gradient_as_bucket_view=as_view, bucket_cap_mb=512 / 2**20)
            opt: Any
            if kind == "plain":
                opt = torch.optim.Adam(model.parameters(), lr=0.01)
                ddp.register_comm_hook(None, comm_hook)
            else:
                opt = ZeroRedundancyOptimizer(
                    model.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.01
                )
                hook = hook_with_zero_step_interleaved(comm_hook, ddp, opt)
                ddp.register_comm_hook(None, hook)
            for step in range(4):
                x, y = batch(step, dist.get_rank())
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                if kind == "plain":
                    opt.step()
            results.append([p.detach().clone() for p in model.parameters()])
        assert_same(results[1], results[0], f"{comm_hook.__name__}, as_view={as_view}")


def _api_rank() -> list[str]:
    _errors_with_a_process_group()
    records: list[str] = []
    _warns_once_when_step_is_called_with_a_hook(records)
    _add_param_group_and_freezing()
    _bucket_views_survive_steps()
    _partition_views_match_torch()
    _overlap_with_other_ddp_settings()
    return records


def test_errors_and_behaviours_on_two_ranks() -> None:
    run_ranks(_api_rank, 2, timeout=120)
