"""The process group: joining it, leaving it, and telling a dead peer from a bug."""

from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from .config import TrainConfig


@dataclass(frozen=True)
class DistEnv:
    """Where this rank stands: read once from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """Rank 0 prints, plots and owns the checkpoint folder's bookkeeping."""
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _attempt_store(timeout: timedelta) -> Store | None:
    """Under torchrun, the agent's store seen through a prefix of this attempt.

    [Note: a restarted job needs its own keys]
    torchrun's agent keeps one TCP store for all the attempts of a job (``--max-restarts``)
    and torch's ``env://`` initialization adds no per-attempt prefix. A restarted rank
    could then read the address its peer published in the previous attempt (a dead
    process) and wait for it: seen here as gloo's ``connectFullMesh`` hanging for
    5 x --pg-timeout, or failing (2 of 8 runs of the restart test, before this; 0 of 5
    after). Prefixing the keys with the attempt number (TORCHELASTIC_RESTART_COUNT)
    keeps every attempt to its own."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return PrefixStore(f"tinygpt/attempt_{attempt}/", store)


def init_distributed(cfg: TrainConfig) -> DistEnv:
    """Join the process group torchrun describes in the environment (or make a
    one-rank group when started without torchrun), with ``--pg-timeout`` on every
    collective so a lost peer is an error, not a hang."""
    if "RANK" not in os.environ:  # plain `python train.py`: one rank
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )  # fmt: skip
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch sees no CUDA device")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs: "
                "lower torchrun's --nproc-per-node or use --device cpu"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=cfg.pg_timeout)
    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend,
            store=store,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    env = DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=backend,
    )
    cfg.check_world_size(env.world_size)
    return env


def destroy_distributed() -> None:
    """Leave the process group if we joined one; safe to call on any exit path.

    [Note: who destroys the process group]
    Drop every wrapped model *before* calling this. DDP's C++ reducer holds a reference
    to the gloo process group; if it is the last holder, the group's destructor runs
    inside the reducer's deallocation with the GIL held and joins gloo's worker
    threads, while a worker may still be freeing the tensors of the last collective,
    which needs the GIL: a deadlock at exit (seen on torch 2.13 after the sampling
    broadcasts). When ``destroy_process_group`` drops the last reference instead,
    torch releases the GIL around the destructor and the workers finish."""
    gc.collect()  # free dropped models now, while the group is still registered
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# Words in the errors gloo and NCCL raise when a peer is gone or silent.
_PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "socket",
    "nccl",
    "gloo",
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from a collective whose peers died or stopped answering,
    as opposed to a bug on this rank (which keeps its traceback)."""
    if isinstance(exc, dist.DistError):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc).lower()
        return any(marker in message for marker in _PEER_FAILURE_MARKERS)
    return False
