"""Which CUDA device a rank computes on when the caller did not say.

[Note: choosing the CUDA device]
Under ``torchrun`` every rank starts on ``cuda:0``. A rank that never called
``torch.cuda.set_device`` and passed no ``device_id`` would put its unit on
``cuda:0`` too, every rank of the node on one GPU, and NCCL refuses the
duplicate device at the first collective. So when the current device is still
the default one (index 0) and ``LOCAL_RANK`` is set, the rank's GPU is
``cuda:LOCAL_RANK``; a current device other than 0 means the caller chose it,
and it wins. Without ``LOCAL_RANK`` the current device is the answer, as in
torch's FSDP. Everything else a unit allocates or communicates (object
collectives in ckpt and zero_optim, the rate limiter's events) then goes to
the unit's device, never to "the current device", so the choice here is the
only place the current device is read.
"""

from __future__ import annotations

import os

import torch

__all__ = ["default_cuda_device", "pins_host_memory"]


def default_cuda_device() -> torch.device:
    """The CUDA device for a unit whose ``device_id`` gave no index.

    See [Note: choosing the CUDA device]. Raises when ``LOCAL_RANK`` names no
    visible GPU, since guessing would put two ranks on one device.
    """
    current = torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK")
    if local is None or current != 0:
        return torch.device("cuda", current)
    try:
        index = int(local)
    except ValueError:
        raise ValueError(
            f"LOCAL_RANK={local!r} is not an integer, so FSDP cannot tell which GPU this "
            "rank uses; call torch.cuda.set_device(<this rank's GPU>) before wrapping or "
            "pass device_id="
        ) from None
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise RuntimeError(
            f"LOCAL_RANK={index} but this process sees {count} CUDA device(s) "
            f"(cuda:0..cuda:{count - 1}), so FSDP cannot pick this rank's GPU; call "
            "torch.cuda.set_device(<this rank's GPU>) before wrapping or pass device_id= "
            "(check CUDA_VISIBLE_DEVICES and --nproc-per-node)"
        )
    return torch.device("cuda", index)


def pins_host_memory(compute_device: torch.device) -> bool:
    """Whether ``CPUOffload`` shards and gradients live in pinned (page-locked) host memory.

    Only a CUDA compute device gains from it: copies between pinned host memory
    and the GPU run asynchronously (``non_blocking=True``) instead of stalling
    the CPU. On a CPU compute device the "host" and the "device" are one memory,
    so nothing is pinned and nothing changes.
    """
    return compute_device.type == "cuda" and torch.cuda.is_available()
