"""A unit's flat shards rearranged for a checkpoint, without gathering the unit.

[Note: a unit's bytes move once]
Gathering a whole unit on every rank to hand each rank back a 1/N share of it (what a
SHARDED state dict needs, see [Note: SHARDED is chunked per original parameter] in
``_wrappers/sharded_chunks.py``) moves N times the unit's bytes and holds the unit unsharded on
every rank. Both layouts are known everywhere, so each rank can instead work out
which of its flat elements another rank's chunks need and send exactly those:

* ``shard_to_chunks``: flat shards -> this rank's dimension-0 chunk of each original
  parameter, one ``all_to_all_single`` per unit (each element crosses the wire at
  most once; a rank holds its shard and its chunks, about twice a shard);
* ``chunks_to_shard``: the mirror image for loading;
* ``gather_params_on_rank0``: the full parameters on global rank 0 alone (a FULL
  ``rank0_only`` state dict): the other ranks only send their shards, and rank 0
  copies them into the parameters one shard at a time.

The units and their layouts come from fsdp's public :mod:`fsdp.units`. Every
interval below is in the unpadded flat tensor's coordinates: parameter ``e``
is ``flat[e.start : e.end]``, rank ``s``'s shard is ``flat[s * S : (s + 1) * S]``
(``S = shard_numel``, padding at the very end). A rank's chunk of ``e`` is a
contiguous run of rows, so a contiguous flat interval; the intervals of one rank are
disjoint and increase with the parameters, which is why the pieces one rank
receives, concatenated in source-rank order, are its chunks in parameter order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ckpt._wrappers.sharded_chunks import Interval, chunk_intervals, chunk_shape
from fsdp.units import FlatUnit

__all__ = ["chunks_to_shard", "gather_params_on_rank0", "shard_to_chunks"]


def _overlaps(wanted: Sequence[Interval], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Parts of ``wanted`` inside ``[lo, hi)``: ``(packed, offset, numel)`` each.

    ``packed`` is where the part sits in ``wanted``'s intervals laid end to end,
    ``offset`` where it sits relative to ``lo``.
    """
    out: list[tuple[int, int, int]] = []
    packed = 0
    for start, end in wanted:
        a, b = max(start, lo), min(end, hi)
        if b > a:
            out.append((packed + a - start, a - lo, b - a))
        packed += end - start
    return out


def _comm_device(group: Any, device: torch.device) -> torch.device:
    """Where the exchange's tensors must be: gloo does send/recv and all-to-all on host
    memory only, so a gloo group (also with CUDA tensors) stages through the CPU."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else device


def _cat(parts: list[Tensor], like: Tensor) -> Tensor:
    return torch.cat(parts) if parts else like.new_empty(0)


def _all_to_all(sends: list[Tensor], recv_numels: list[int], group: Any, like: Tensor) -> Tensor:
    """One ``all_to_all_single``: ``sends[r]`` to rank ``r``; what rank ``s`` sent, in order."""
    out = like.new_empty(sum(recv_numels))
    dist.all_to_all_single(
        out,
        _cat(sends, like),
        output_split_sizes=recv_numels,
        input_split_sizes=[t.numel() for t in sends],
        group=group,
    )
    return out


def shard_to_chunks(unit: FlatUnit, shard: Tensor, device: torch.device) -> list[Tensor]:
    """This rank's ``Shard(0)`` chunk of every parameter, from every rank's flat ``shard``.

    ``shard`` is laid out like the unit's FlatParameter (this rank's padded chunk).
    A collective over the unit's group: see [Note: a unit's bytes move once]. The
    chunks are fresh tensors on ``device`` that share no storage with each other.
    """
    cfg, size, entries = unit.sharding, unit.layout.shard_numel, unit.params
    src = shard.detach().to(_comm_device(cfg.group, cfg.device))
    mine = chunk_intervals(entries, cfg.world_size, cfg.rank, scalars_everywhere=True)
    lo, hi = cfg.rank * size, (cfg.rank + 1) * size
    sends = []
    for dst in range(cfg.world_size):
        wanted = chunk_intervals(entries, cfg.world_size, dst, scalars_everywhere=True)
        sends.append(_cat([src[o : o + n] for _, o, n in _overlaps(wanted, lo, hi)], src))
    recv = [
        sum(n for *_, n in _overlaps(mine, s * size, (s + 1) * size)) for s in range(cfg.world_size)
    ]
    packed = _all_to_all(sends, recv, cfg.group, src)
    del sends
    chunks: list[Tensor] = []
    at = 0
    for e, (start, end) in zip(entries, mine, strict=True):
        piece = packed[at : at + end - start]
        at += end - start
        shape = chunk_shape(e.shape, cfg.world_size, cfg.rank)
        chunks.append(piece.view(shape).to(device, copy=True))
    return chunks


def chunks_to_shard(
    unit: FlatUnit, chunks: Sequence[Tensor], dtype: torch.dtype | None = None
) -> Tensor:
    """This rank's padded flat shard from every rank's ``Shard(0)`` chunks of the parameters.

    ``chunks[i]`` is this rank's chunk of ``unit.params[i]`` (shape from :func:`chunk_shape`);
    the padding comes back as zeros. A collective over the unit's group, the mirror
    image of :func:`shard_to_chunks`. Returns a tensor of ``dtype`` (the
    FlatParameter's by default: optimizer state may differ) on the FlatParameter's
    device.
    """
    cfg, size, entries = unit.sharding, unit.layout.shard_numel, unit.params
    dtype = dtype or unit.flat_param.dtype
    device = _comm_device(cfg.group, cfg.device)
    mine = chunk_intervals(entries, cfg.world_size, cfg.rank, scalars_everywhere=False)
    local = _cat(
        [
            c.detach().reshape(-1)[: end - start].to(device, dtype)
            for c, (start, end) in zip(chunks, mine, strict=True)
        ],
        torch.empty(0, dtype=dtype, device=device),
    )
    sends = [
        _cat([local[p : p + n] for p, _, n in _overlaps(mine, d * size, (d + 1) * size)], local)
        for d in range(cfg.world_size)
    ]
    lo, hi = cfg.rank * size, (cfg.rank + 1) * size
    theirs = [
        _overlaps(chunk_intervals(entries, cfg.world_size, s, False), lo, hi)
        for s in range(cfg.world_size)
    ]
    packed = _all_to_all(sends, [sum(n for *_, n in parts) for parts in theirs], cfg.group, local)
    shard = torch.zeros(size, dtype=dtype, device=device)
    at = 0
    for parts in theirs:
        for _, offset, n in parts:
            shard[offset : offset + n] = packed[at : at + n]
            at += n
    return shard.to(unit.flat_param.device)


def _recv_buffer(numel: int, like: Tensor) -> Tensor:
    """Where one peer's shard lands on rank 0 (a function of its own so tests count it)."""
    return like.new_empty(numel)


def gather_params_on_rank0(
    unit: FlatUnit, shard: Tensor, device: torch.device
) -> list[Tensor] | None:
    """Every parameter's full tensor (fresh, on ``device``) on global rank 0; None elsewhere.

    The other ranks of the unit's group send their shards point to point; rank 0 takes
    them one at a time and copies each piece straight into the parameter it belongs to,
    so besides the result it holds one shard in transit, never the unit unsharded (a
    gather would hold it twice: its receive buffer and the copies). With hybrid
    sharding the shard groups without rank 0 hold replicas of the same data and do
    nothing.
    """
    cfg, entries = unit.sharding, unit.params
    is_rank0 = dist.get_rank() == 0
    if not unit.sharded:  # ``shard`` is the whole flat tensor
        if not is_rank0:
            return None
        return [shard[e.start : e.end].view(e.shape).to(device, copy=True) for e in entries]
    ranks = dist.get_process_group_ranks(cfg.group)
    if 0 not in ranks:
        return None
    src = shard.detach().to(_comm_device(cfg.group, cfg.device)).contiguous()
    if not is_rank0:
        dist.send(src, dst=0, group=cfg.group)
        return None
    outs = [torch.empty(e.shape, dtype=src.dtype, device=device) for e in entries]
    flat_outs = [o.view(-1) for o in outs]
    size = unit.layout.shard_numel
    for peer in range(cfg.world_size):
        buf = src
        if peer != cfg.rank:
            buf = _recv_buffer(size, src)
            dist.recv(buf, src=ranks[peer], group=cfg.group)
        lo, hi = peer * size, (peer + 1) * size
        for e, out in zip(entries, flat_outs, strict=True):
            a, b = max(e.start, lo), min(e.end, hi)
            if b > a:
                out[a - e.start : b - e.start].copy_(buf[a - lo : b - lo])
        del buf
    return outs
