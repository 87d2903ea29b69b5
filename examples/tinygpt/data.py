"""The corpus as bytes, and which sequences each step trains on.

[Note: data order independent of the world size]
The sampler decides the *global* batch of every step (the start offsets of
``batch_size`` windows) from nothing but ``(seed, epoch, cursor)``; each rank then
takes its contiguous slice of that batch (``rank_slice``). So the sequences a step
trains on do not depend on how many ranks share them, and the gradient (the mean over
the global batch) is the same at any world size up to float rounding. Its state is two
integers, saved in every checkpoint, so a resumed run continues with exactly the
batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Corpus:
    """The training and validation bytes, as 1-D uint8 tensors."""

    train: torch.Tensor  # 1D uint8
    val: torch.Tensor  # 1D uint8


def load_corpus(path: Path, val_fraction: float, seq_len: int) -> Corpus:
    """Read ``path`` as bytes and hold out its last ``val_fraction`` for validation."""
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    n_val = int(len(data) * val_fraction)
    corpus = Corpus(train=data[: len(data) - n_val], val=data[len(data) - n_val :])
    for name, part in (("training", corpus.train), ("validation", corpus.val)):
        if len(part) < 2 * (seq_len + 1):
            raise ValueError(
                f"{path}: the {name} part has {len(part)} bytes, too few for sequences "
                f"of --seq-len {seq_len}; use a longer text or a shorter --seq-len"
            )
    return corpus


def epoch_windows(num_tokens: int, seq_len: int, seed: int, epoch: int) -> torch.Tensor:
    """Start offsets of one epoch's windows, shuffled: non-overlapping windows of
    ``seq_len + 1`` bytes (input plus the next-byte target) from a random shift in
    ``[0, seq_len)``, so every epoch cuts the text at different places.

    A pure function of its arguments (its own generator, never the global RNG)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    shift = int(torch.randint(0, seq_len, (1,), generator=g))
    count = (num_tokens - 1 - shift) // seq_len  # windows [s, s + seq_len] inclusive
    if count < 1:
        raise ValueError(f"{num_tokens} tokens hold no window of {seq_len + 1}")
    return shift + seq_len * torch.randperm(count, generator=g)


class BatchSampler:
    """Hands out each step's global batch of window starts, epoch after epoch, and
    saves where it is (see [Note: data order independent of the world size])."""

    num_tokens: int
    seq_len: int
    seed: int
    epoch: int  # the epoch the next window comes from
    cursor: int  # index of the next window inside that epoch's permutation
    _windows: torch.Tensor | None  # 1D int64, cache of epoch_windows(..., self.epoch)

    def __init__(self, num_tokens: int, seq_len: int, seed: int) -> None:
        self.num_tokens = num_tokens
        self.seq_len = seq_len
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._windows = None

    def _epoch_windows(self) -> torch.Tensor:
        if self._windows is None:
            self._windows = epoch_windows(self.num_tokens, self.seq_len, self.seed, self.epoch)
        return self._windows

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """The next ``batch_size`` window starts (1-D int64), crossing into the next
        epoch when this one runs out."""
        parts: list[torch.Tensor] = []
        needed = batch_size
        while needed:
            windows = self._epoch_windows()
            take = windows[self.cursor : self.cursor + needed]
            parts.append(take)
            needed -= len(take)
            self.cursor += len(take)
            if self.cursor == len(windows):
                self.epoch, self.cursor, self._windows = self.epoch + 1, 0, None
        return torch.cat(parts)

    def state_dict(self) -> dict[str, int]:
        """The sampler's position: with the seed, all it needs to continue."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position (of a sampler with the same seed)."""
        if state["seed"] != self.seed:
            raise ValueError(
                f"the checkpoint's data order was seeded with {state['seed']}, this run "
                f"with --seed {self.seed}; resume with --seed {state['seed']}"
            )
        self.epoch, self.cursor, self._windows = state["epoch"], state["cursor"], None


def rank_slice(global_batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous share of the global batch (equal shares; the config
    checks divisibility)."""
    per_rank = len(global_batch) // world_size
    return global_batch[rank * per_rank : (rank + 1) * per_rank]


def windows(
    tokens: torch.Tensor, starts: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, both (len(starts), seq_len) int64."""
    index = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    chunk = tokens[index].long()
    return chunk[:, :-1], chunk[:, 1:]
