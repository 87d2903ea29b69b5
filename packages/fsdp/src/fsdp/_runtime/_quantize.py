"""Block-wise int8 quantization for communication, and the policy that asks for it.

[Note: block-wise quantization]
A tensor is cut into blocks of ``block_size`` consecutive elements (the last one
zero-padded); each block is sent as ``block_size`` int8 codes and one fp32 scale,
``scale = absmax(block) / 127`` and ``code = round(x / scale)``, so an element
comes back as ``code * scale`` within ``scale / 2 = absmax(block) / 254`` of its
value (plus fp32 rounding), and zeros come back exactly. One scale per block
(ZeRO++'s qwZ and qgZ) rather than one per tensor keeps an outlier from
flattening the resolution of the whole tensor: it costs only its own block.
A block of all zeros has scale 0 and codes 0. A block holding an inf or a NaN
has a non-finite scale, its codes are 0 and it comes back as NaN in every
element, so a non-finite gradient stays non-finite after a quantized reduction
(``ShardedGradScaler`` and users checking for overflow still see it).

On the wire one tensor of ``numel`` elements is a *payload* of bytes (see
:class:`BlockCodec`): the codes of every block, then the scales, aligned to 4
bytes so that the receiver reads them in place as fp32. Several payloads of the
same codec laid end to end (one per rank) are rows of one ``uint8`` matrix,
which is what the quantized all-gather and all-to-all move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["BlockCodec", "QuantizedCommPolicy"]

_CHUNK_ELEMENTS = 1 << 17  # a chunk's fp32 scratch (512 KiB) stays in a core's cache

_WEIGHT_MODES = (None, "int8")
_GRADIENT_MODES = (None, "int8", "bf16")


@dataclass(frozen=True)
class QuantizedCommPolicy:
    """Opt-in lossy communication: block-quantized gathers and gradient reductions.

    Taken by ``fully_shard(..., comm_policy=...)`` and
    ``FullyShardedDataParallel(..., comm_policy=...)`` (an extension: torch's FSDP
    has no such option). Where the link between ranks, not the computation,
    decides the step time, it cuts the bytes FSDP moves per step to about a
    quarter of fp32's (ZeRO++'s qwZ and qgZ):

    - ``weights="int8"``: each rank quantizes its shard block-wise (one fp32
      scale per ``block_size`` elements, see [Note: block-wise quantization]),
      the int8 codes and scales are all-gathered and every rank dequantizes
      them into the compute dtype on arrival. The sharded parameters (the fp32
      or bf16 master weights the optimizer steps) are never quantized; only
      the gathered copy used by forward and backward carries the error, at
      most ``absmax(block) / 254`` per element.
    - ``gradients="int8"`` or ``"bf16"``: the padded gradient is cut into one
      chunk per rank, each chunk quantized (int8 with block scales, or cast to
      bf16) and exchanged by an all-to-all; each rank dequantizes the chunks it
      receives and sums them in fp32 (qgZ's scheme: one quantization per
      element, not one per hop of a ring); its own chunk, which never leaves
      it, enters the sum exact. With int8 each other rank's contribution to an
      element is off by at most ``absmax(its block) / 254``. Hybrid
      sharding then all-reduces the result across replicas in full precision.

    ``None`` keeps that direction exact. Units or groups sharded over one rank
    (or ``NO_SHARD``) move nothing to quantize and stay exact; so do
    ``summon_full_params``, state dicts and every other gather outside
    forward and backward. Non-floating parameters are never quantized.

    Attributes:
        weights: ``"int8"`` or ``None``.
        gradients: ``"int8"``, ``"bf16"`` or ``None``.
        block_size: elements per quantization block; each block adds 4 bytes
            of scale to its ``block_size`` bytes (64: 0.27x of fp32's bytes,
            256: 0.25x). The default is 64: over four seeds of 400-step
            ``examples/train.py`` runs it ended 1.5% above the exact mean
            validation loss, 256 2.5% (the fsdp README). Smaller blocks likely
            help because a block may span two parameters of a flat shard (a
            LayerNorm's weights near 1 beside its biases near 0, which then
            lose their resolution).
    """

    weights: str | None = "int8"
    gradients: str | None = "int8"
    block_size: int = 64

    def __post_init__(self) -> None:
        if self.weights not in _WEIGHT_MODES:
            raise ValueError(
                f"QuantizedCommPolicy.weights={self.weights!r} is not supported; use 'int8' "
                "(block-quantized all-gather) or None (exact)"
            )
        if self.gradients not in _GRADIENT_MODES:
            raise ValueError(
                f"QuantizedCommPolicy.gradients={self.gradients!r} is not supported; use "
                "'int8', 'bf16' or None (exact)"
            )
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(
                f"QuantizedCommPolicy.block_size must be an int, got {self.block_size!r}"
            )
        if self.block_size < 1:
            raise ValueError(
                f"QuantizedCommPolicy.block_size={self.block_size} must be at least 1 "
                "(tens to a few hundred is usual; the default is 64)"
            )


def to_comm_policy(value: object) -> QuantizedCommPolicy | None:
    """``value`` checked as a ``comm_policy`` argument (``None`` or a policy)."""
    if value is None or isinstance(value, QuantizedCommPolicy):
        return value
    raise TypeError(
        f"comm_policy must be a fsdp.QuantizedCommPolicy or None, got {value!r} "
        f"({type(value).__name__}); e.g. comm_policy=fsdp.QuantizedCommPolicy(weights='int8', "
        "gradients='int8')"
    )


@dataclass(frozen=True)
class BlockCodec:
    """The payload layout for tensors of ``numel`` elements in blocks of ``block_size``.

    A payload is ``nbytes`` bytes: ``blocks * block_size`` int8 codes (the
    padding's codes are 0), zero to three bytes of alignment, then ``blocks``
    fp32 scales; ``nbytes`` is a multiple of 4, so payloads laid end to end keep
    every scale aligned. ``numel`` 0 gives an empty payload.
    """

    numel: int
    block_size: int

    @property
    def blocks(self) -> int:
        """Blocks per tensor: ``ceil(numel / block_size)``."""
        return -(-self.numel // self.block_size)

    @property
    def codes_bytes(self) -> int:
        """Bytes of codes: ``blocks * block_size`` (one int8 per element and padding)."""
        return self.blocks * self.block_size

    @property
    def scales_offset(self) -> int:
        """Where the scales start: ``codes_bytes`` rounded up to a multiple of 4."""
        return -(-self.codes_bytes // 4) * 4

    @property
    def nbytes(self) -> int:
        """Bytes of one payload."""
        return self.scales_offset + 4 * self.blocks

    # [Note: codec passes] The codec runs on the critical path of every gather and
    # reduction, on the CPU with one thread per rank. Two things decide its speed there:
    # a fresh tensor of the shard's size costs a page fault per 4 KiB (allocating the
    # fp32 temporary of a 15M-element shard took longer than the multiply that filled
    # it), and an operation mixing int8 and fp32 inputs converts through a slow generic
    # path (3 ns per element against 1 for a copy and an in-place multiply). So the
    # blocks are processed in chunks of about 128K elements through one small scratch
    # buffer that stays in cache, every operation has inputs of one dtype, and the
    # blocks are views of the rows (only the short last block is copied). Measured on
    # 15M elements, one thread, blocks of 256: encode 5.0 -> 1.8-1.9 ns per element,
    # decode 3.3 -> 0.7 (blocks of 64: 2.3 and 0.8).
    # On an accelerator the whole tensor is one chunk (kernel launches cost more than
    # memory there).

    @property
    def full_blocks(self) -> int:
        """Blocks without padding: ``numel // block_size``."""
        return self.numel // self.block_size

    def _chunks(self, rows: Tensor) -> list[tuple[Tensor, slice]]:
        """The full blocks of ``rows`` (``(r, numel)``) as ``(r, k, block_size)`` views
        of at most a cache's worth of elements each, with the blocks each covers."""
        r, bs, full = rows.shape[0], self.block_size, self.full_blocks
        if not full:
            return []
        step = full if rows.device.type != "cpu" else max(1, _CHUNK_ELEMENTS // (r * bs))
        blocks = rows[:, : full * bs].view(r, full, bs)
        spans = [slice(s, min(s + step, full)) for s in range(0, full, step)]
        return [(blocks[:, span], span) for span in spans]

    def _tail(self, rows: Tensor) -> list[tuple[Tensor, slice]]:
        """The short last block of ``rows``, zero-padded into a copy (or nothing)."""
        full = self.full_blocks
        if full == self.blocks:
            return []
        tail = rows.new_zeros(rows.shape[0], 1, self.block_size)
        tail[:, 0, : self.numel - full * self.block_size] = rows[:, full * self.block_size :]
        return [(tail, slice(full, full + 1))]

    def encode(self, rows: Tensor, out: Tensor) -> None:
        """Quantize each row of ``rows`` (``(r, numel)``, floating) into the same row of
        ``out`` (``(r, nbytes)`` uint8, contiguous)."""
        r = rows.shape[0]
        if self.blocks == 0 or r == 0:
            return
        codes_out = self._codes(out).view(r, self.blocks, self.block_size)
        scales_out = self._scales(out)
        on_cpu = rows.device.type == "cpu"
        scratch: Tensor | None = None
        for x, blocks in self._chunks(rows) + self._tail(rows):
            high, low = x.amax(dim=2), x.amin(dim=2)  # 2.5x faster than aminmax on CPU
            scales = torch.maximum(high, low.neg()).to(torch.float32).div_(127.0)
            finite = torch.isfinite(scales)
            usable = finite & (scales > 0)  # else: zeros, or inf/NaN
            inverse = torch.where(usable, torch.where(usable, scales, 1.0).reciprocal(), 0.0)
            if scratch is None or scratch.shape[1] < x.shape[1]:
                scratch = torch.empty(x.shape, dtype=torch.float32, device=x.device)
            codes = scratch[:, : x.shape[1]]
            # |x| <= absmax, so |x * 127 / absmax| rounds to at most 127: no clamp needed.
            # An inf or NaN times the zero inverse is NaN: code 0 (the scale keeps it).
            torch.mul(x, inverse.unsqueeze(2), out=codes).round_()
            if not on_cpu or not bool(finite.all()):
                codes.nan_to_num_(0.0)  # (a check on the CPU spares a pass; on CUDA a sync)
            codes_out[:, blocks].copy_(codes)
            scales_out[:, blocks].copy_(scales)

    def decode(self, payloads: Tensor, out: Tensor) -> None:
        """Dequantize each row of ``payloads`` (``(r, nbytes)`` uint8) into the same row
        of ``out`` (``(r, numel)``, any floating dtype; computed in fp32, then cast)."""
        self._decode(payloads, out, accumulate=False)

    def decode_sum(
        self, payloads: Tensor, out: Tensor, *, exact: tuple[int, Tensor] | None = None
    ) -> None:
        """The sum over the rows of ``payloads``, dequantized, into ``out`` (``numel``
        fp32 elements), added in row order; ``exact=(i, values)`` takes ``values`` for
        row ``i`` instead of decoding it (a rank's own chunk, which never left it)."""
        for i in range(payloads.shape[0]):
            if exact is not None and i == exact[0]:
                if i == 0:
                    out.copy_(exact[1])
                else:
                    out.add_(exact[1])
            else:
                self._decode(payloads[i : i + 1], out.view(1, -1), accumulate=i > 0)

    def _decode(self, payloads: Tensor, out: Tensor, *, accumulate: bool) -> None:
        r = payloads.shape[0]
        if self.blocks == 0 or r == 0:
            return
        bs, full = self.block_size, self.full_blocks
        codes = self._codes(payloads).view(r, self.blocks, bs)
        scales = self._scales(payloads).unsqueeze(2)
        in_place = out.dtype == torch.float32 and not accumulate
        scratch: Tensor | None = None
        if full != self.blocks:  # the padded last block: decoded apart, then cut
            value = codes[:, full].to(torch.float32).mul_(scales[:, full])
            target, n = out[:, full * bs :], self.numel - full * bs
            if accumulate:
                target.add_(value[:, :n])
            else:
                target.copy_(value[:, :n])
        for dest, blocks in self._chunks(out):
            if in_place:  # int8 -> fp32 straight into the destination, scaled there
                dest.copy_(codes[:, blocks]).mul_(scales[:, blocks])
                continue
            if scratch is None or scratch.shape[1] < dest.shape[1]:
                scratch = torch.empty(dest.shape, dtype=torch.float32, device=dest.device)
            value = scratch[:, : dest.shape[1]].copy_(codes[:, blocks])
            if accumulate:
                dest.addcmul_(value, scales[:, blocks])
            else:
                dest.copy_(value.mul_(scales[:, blocks]))

    def _codes(self, payloads: Tensor) -> Tensor:  # (r, codes_bytes) int8 view
        return payloads[:, : self.codes_bytes].view(torch.int8)

    def _scales(self, payloads: Tensor) -> Tensor:  # (r, blocks) fp32 view
        return payloads[:, self.scales_offset :].view(torch.float32)
