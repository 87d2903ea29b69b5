"""A small GPT-style language model for the benchmarks.

Pre-norm decoder blocks (causal self-attention and an MLP), learned position
embeddings, an untied output head. Every size is a constructor argument, so a
benchmark picks the balance of compute (``seq_len``, batch) and parameters
(``d_model``, ``n_layers``, ``vocab``) it wants to stress. :class:`Block` is
the unit a wrap policy wraps (``ModuleWrapPolicy({Block})``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "Block", "GPTConfig", "lm_loss", "random_tokens"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The model's sizes."""

    vocab: int = 512
    """Vocabulary size: rows of the embedding and of the output head."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of :class:`Block` s."""
    n_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""
    seq_len: int = 64
    """Longest sequence (rows of the position embedding)."""

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_layers", "n_heads", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model({self.d_model}) % n_heads({self.n_heads}) = "
                f"{self.d_model % self.n_heads}: n_heads must divide d_model"
            )


class Block(nn.Module):
    """One pre-norm decoder block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.ln_1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        """Causal self-attention then the MLP, each added to the residual stream."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layers`` blocks, a final norm and the head."""

    def __init__(
        self,
        *,
        vocab: int = 512,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        seq_len: int = 64,
    ) -> None:
        super().__init__()
        self.config = GPTConfig(
            vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, seq_len=seq_len
        )
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(self.config) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits of shape ``(batch, seq, vocab)`` for ``tokens`` of shape ``(batch, seq)``."""
        t = tokens.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len={self.config.seq_len}")
        positions = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.ln_f(x))
        return logits


def lm_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """Next-token cross-entropy of ``model`` (a GPT, possibly wrapped) on ``tokens``."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def random_tokens(
    config: GPTConfig, batch: int, seed: int, device: torch.device | str = "cpu"
) -> Tensor:
    """``batch`` sequences of ``seq_len`` random tokens, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab, (batch, config.seq_len), generator=g).to(device)
