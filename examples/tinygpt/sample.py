"""Text from the trained model, so the user sees what it learned."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: bytes,
    *,
    new_bytes: int,
    seq_len: int,
    temperature: float,
    seed: int,
    device: torch.device,
    on_byte: Callable[[], None] | None = None,
) -> bytes:
    """Continue ``prompt`` by ``new_bytes`` sampled bytes (collective: every rank calls
    it with the same arguments).

    Every rank runs the same forward passes, because a sharded model's forward is itself
    collective; rank 0 draws each byte and broadcasts it, so all ranks extend the same
    text even if their logits differed in the last bit. ``on_byte`` is called after
    each byte (for a progress bar)."""
    was_training = model.training
    model.eval()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.tensor(list(prompt) or [ord("\n")], dtype=torch.long, device=device)
    for _ in range(new_bytes):
        context = tokens[-seq_len:][None, :]
        logits = model(context)[0, -1].float().cpu()
        probs = torch.softmax(logits / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator).to(device)
        dist.broadcast(nxt, src=0)
        tokens = torch.cat([tokens, nxt])
        if on_byte is not None:
            on_byte()  # a progress bar's step
    model.train(was_training)
    return bytes(tokens.tolist())
