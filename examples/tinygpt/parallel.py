"""Applying data parallelism to the model, and the optimizer that goes with it.

The order, as in ``build_parallel``:
1. the model is built on every rank with the same seed (identical replicas);
2. it is wrapped: ``apply_fsdp`` (sharded by FSDP1's wrapper), ``apply_fully_shard``
   (sharded by FSDP2's ``fully_shard``, in place) or ``apply_ddp`` (replicated);
3. the optimizer is built on the *wrapped* model's parameters, because FSDP replaces
   the parameters by its sharded flat parameters (an optimizer built before wrapping
   would update tensors nobody uses).

``--impl torch`` swaps our packages for PyTorch's own FullyShardedDataParallel,
fully_shard and ZeroRedundancyOptimizer: same arguments, so the program doubles as a
side-by-side comparison.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import TrainConfig
from .distributed import DistEnv
from .model import GPT, Block


class WrapperNotAvailableError(RuntimeError):
    """The chosen --wrapper needs a package of ours that is not installed or not
    finished yet."""


# Where each implementation's API lives; ours mirror torch's names exactly.
_MODULES = {
    ("fsdp", "ours"): "fsdp",
    ("fsdp", "torch"): "torch.distributed.fsdp",
    ("fsdp.wrap", "ours"): "fsdp.wrap",
    ("fsdp.wrap", "torch"): "torch.distributed.fsdp.wrap",
    ("zero", "ours"): "zero_optim",
    ("zero", "torch"): "torch.distributed.optim",
}


def _api(what: str, impl: str, names: Iterable[str], flag: str) -> types.ModuleType:
    """Import the module that provides ``names``, or say clearly why it cannot."""
    module_name = _MODULES[(what, impl)]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise WrapperNotAvailableError(
            f"{flag} needs the {module_name!r} package, which is not installed: "
            f"`pip install packages/{module_name.split('.')[0]}` (or run `nox -s train`), "
            "or use --wrapper ddp"
        ) from exc
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise WrapperNotAvailableError(
            f"{flag} is not available yet: {module_name!r} does not provide "
            f"{', '.join(missing)} (the package is still being written); use "
            "--wrapper ddp for now, or --impl torch to run PyTorch's own implementation"
        )
    return module


def check_available(cfg: TrainConfig) -> None:
    """Fail in the first second, before any process group or model exists, if the
    chosen wrapper cannot be built."""
    if cfg.wrapper == "fsdp":
        names = ["FullyShardedDataParallel", "ShardingStrategy", "MixedPrecision", "CPUOffload"]
        _api("fsdp", cfg.impl, names, "--wrapper fsdp")
        _api("fsdp.wrap", cfg.impl, ["ModuleWrapPolicy"], "--wrapper fsdp")
    elif cfg.wrapper == "fully_shard":
        names = ["fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy"]
        _api("fsdp", cfg.impl, names, "--wrapper fully_shard")
    elif cfg.wrapper == "ddp-zero":
        _api("zero", cfg.impl, ["ZeroRedundancyOptimizer"], "--wrapper ddp-zero")


def apply_fsdp(model: GPT, cfg: TrainConfig, env: DistEnv) -> nn.Module:
    """Shard the model: one FSDP unit per transformer block plus the root (embeddings,
    final norm, head), with the chosen strategy, bf16 compute and CPU offload."""
    api = _api("fsdp", cfg.impl, ["FullyShardedDataParallel"], "--wrapper fsdp")
    wrap = _api("fsdp.wrap", cfg.impl, ["ModuleWrapPolicy"], "--wrapper fsdp")
    mixed_precision = None
    if cfg.mixed_precision == "bf16":
        # bf16 all-gathers and compute; gradients reduced in fp32 for accuracy.
        mixed_precision = api.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
        )
    wrapped: nn.Module = api.FullyShardedDataParallel(
        model,
        sharding_strategy=api.ShardingStrategy[cfg.sharding_strategy],
        auto_wrap_policy=wrap.ModuleWrapPolicy({Block}),
        mixed_precision=mixed_precision,
        cpu_offload=api.CPUOffload(offload_params=True) if cfg.cpu_offload else None,
        # torch's FSDP1 on CPU needs device_id=cpu said explicitly; ours accepts either.
        device_id=env.device,
        **_comm_policy(api, cfg),
    )
    return wrapped


def _comm_policy(api: Any, cfg: TrainConfig) -> dict[str, Any]:
    """``comm_policy=`` for --quantized-comm (ours only; nothing for none)."""
    if cfg.quantized_comm == "none":
        return {}
    gradients = "bf16" if cfg.quantized_comm == "int8-bf16" else "int8"
    return {"comm_policy": api.QuantizedCommPolicy(weights="int8", gradients=gradients)}


def apply_fully_shard(model: GPT, cfg: TrainConfig, env: DistEnv) -> nn.Module:
    """Shard the model with FSDP2's ``fully_shard``: each transformer block, then the
    root (embeddings, final norm, head), bottom-up; parameters become ``DTensor`` s."""
    api = _api("fsdp", cfg.impl, ["fully_shard"], "--wrapper fully_shard")
    from torch.distributed.device_mesh import init_device_mesh

    model.to(env.device)
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if cfg.mixed_precision == "bf16":
        # bf16 all-gathers and compute; gradients reduced in fp32 for accuracy.
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if cfg.cpu_offload:
        kwargs["offload_policy"] = api.CPUOffloadPolicy()
    kwargs.update(_comm_policy(api, cfg))
    for module in model.modules():
        if isinstance(module, Block):
            api.fully_shard(module, **kwargs)
    api.fully_shard(model, **kwargs)
    return model


def apply_ddp(model: GPT, cfg: TrainConfig, env: DistEnv) -> nn.Module:
    """Replicate the model; gradients are all-reduced in buckets during backward.

    ``gradient_as_bucket_view`` makes each ``.grad`` a view into DDP's communication
    bucket, so gradients are held once (the byte counts then show DDP's real cost)."""
    del cfg  # same for every DDP configuration
    model.to(env.device)
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)


def build_parallel(model: GPT, cfg: TrainConfig, env: DistEnv) -> nn.Module:
    """Wrap the model as --wrapper says (see the module docstring for the order)."""
    if cfg.wrapper == "fsdp":
        return apply_fsdp(model, cfg, env)
    if cfg.wrapper == "fully_shard":
        return apply_fully_shard(model, cfg, env)
    return apply_ddp(model, cfg, env)


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the wrapped model's (local) parameters; under ddp-zero its state is
    sharded across ranks by ZeroRedundancyOptimizer. The learning rate is set every
    step from ``cfg.lr_at``."""
    kwargs: dict[str, Any] = {
        "lr": cfg.lr_at(1),
        "betas": (0.9, 0.95),
        "weight_decay": cfg.weight_decay,
    }
    if cfg.wrapper == "ddp-zero":
        zero = _api("zero", cfg.impl, ["ZeroRedundancyOptimizer"], "--wrapper ddp-zero")
        optimizer: torch.optim.Optimizer = zero.ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, **kwargs
        )
        return optimizer
    return torch.optim.AdamW(model.parameters(), **kwargs)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeroRedundancyOptimizer keeps its
    shard in an inner ``optim``; the others hold it themselves."""
    inner = getattr(optimizer, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradient norm of the whole model, returning the norm before clipping.

    FSDP's gradients are shards, so only its own ``clip_grad_norm_`` (which reduces the
    squared norms across ranks) sees the global norm; DDP's are full replicas, and
    fully_shard's are ``DTensor`` s, whose norm torch's ``clip_grad_norm_`` reduces."""
    own = getattr(model, "clip_grad_norm_", None)
    if callable(own):
        norm: torch.Tensor = own(max_norm if max_norm > 0 else float("inf"))
        return norm
    if max_norm <= 0:
        max_norm = float("inf")
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


@contextlib.contextmanager
def accumulating(model: nn.Module, last_micro_batch: bool) -> Iterator[None]:
    """Skip DDP's gradient all-reduce on all but the last micro-batch.

    [Note: gradient accumulation under FSDP]
    FSDP has ``no_sync()`` too, but under it every rank keeps *unsharded* gradients
    until the last micro-batch, which gives up the memory FSDP exists to save. We let
    FSDP reduce-scatter after every micro-batch instead: more traffic, sharded memory,
    the same result."""
    if isinstance(model, DistributedDataParallel) and not last_micro_batch:
        with model.no_sync():
            yield
    else:
        yield


def autocast(cfg: TrainConfig, env: DistEnv) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast for the DDP wrappers; FSDP casts through its mixed-precision policy."""
    if cfg.mixed_precision == "bf16" and cfg.wrapper not in ("fsdp", "fully_shard"):
        return torch.autocast(device_type=env.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
