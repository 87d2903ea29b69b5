"""A small GPT: byte embeddings, pre-norm transformer blocks, a linear head.

The block is the unit of sharding: the default FSDP wrap policy makes each ``Block``
its own FlatParameter, and the root unit keeps the embeddings, the final norm and the
head. The head is not tied to the embedding, so no parameter is shared between units.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t only."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        # (B, T, 3C) -> three (B, H, T, C/H)
        q, k, v = (
            t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(batch, time, width))
        return out


class MLP(nn.Module):
    """The position-wise feed-forward layer, four times wider than the residual."""

    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.proj(F.gelu(self.fc(x))))
        return out


class Block(nn.Module):
    """One pre-norm transformer block; the FSDP wrap policy's unit."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """Byte-level GPT: ``forward(tokens)`` maps (B, T) int64 to (B, T, vocab) logits."""

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        n_layer: int,
        n_head: int,
        d_model: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self._init_weights(n_layer)

    def _init_weights(self, n_layer: int) -> None:
        """GPT-2's scheme: N(0, 0.02) everywhere, residual projections scaled down by
        sqrt(2 * n_layer) so the residual stream's variance does not grow with depth."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norms keep (1, 0); biases are zeroed below
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        time = tokens.shape[1]
        if time > self.seq_len:
            raise ValueError(
                f"sequence of {time} tokens is longer than the model's context "
                f"({self.seq_len}); crop it to the last {self.seq_len}"
            )
        pos = torch.arange(time, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits
