"""Block-wise int8 quantization ([Note: block-wise quantization]) without ranks.

The bound every quantized collective relies on: an element comes back within
``absmax(its block) / 254`` of its value (half a step of ``absmax / 127``; we
allow 1e-6 relative on top for fp32 rounding), zeros exactly, an outlier costs
only its own block, non-finite blocks come back NaN, and the payload layout
holds for empty and tiny tensors and any block size.
"""

from __future__ import annotations

import math

import pytest
import torch

import fsdp
from fsdp._runtime._quantize import BlockCodec

SLACK = 1 + 1e-6


def _roundtrip(x: torch.Tensor, block_size: int) -> torch.Tensor:
    codec = BlockCodec(x.numel(), block_size)
    wire = torch.full((1, codec.nbytes), 0xAB, dtype=torch.uint8)  # garbage to overwrite
    codec.encode(x.reshape(1, -1), wire)
    out = torch.full((1, x.numel()), float("nan"), dtype=torch.float32)
    codec.decode(wire, out)
    return out.view(-1)


def _block_bound(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per element: absmax of its block / 254."""
    n = x.numel()
    blocks = -(-n // block_size)
    padded = torch.nn.functional.pad(x.float(), (0, blocks * block_size - n))
    absmax = padded.view(blocks, block_size).abs().amax(dim=1)
    return (absmax / 254).repeat_interleave(block_size)[:n]


@pytest.mark.parametrize("block_size", [1, 3, 64, 256, 1000])
@pytest.mark.parametrize("numel", [1, 5, 255, 256, 257, 4099])
def test_roundtrip_within_half_a_step_per_block(numel: int, block_size: int) -> None:
    g = torch.Generator().manual_seed(numel * 7 + block_size)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel)  # very unequal scales
    back = _roundtrip(x, block_size)
    err = (back - x).abs()
    assert bool((err <= _block_bound(x, block_size) * SLACK).all()), float(err.max())
    # The error is real (this is a lossy format) but no larger than half a step.
    if numel >= 255 and block_size >= 64:
        assert float(err.max()) > 0


def test_zeros_exact_and_outlier_costs_only_its_block() -> None:
    x = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    x[:256] = 0.0  # a block of zeros
    x[300] = 0.0  # a zero inside a normal block
    x[600] = 1e6  # an outlier in the third block
    back = _roundtrip(x, 256)
    assert bool((back[:256] == 0).all()) and float(back[300]) == 0.0
    assert float(back[600]) == 1e6  # the absmax itself is exact (code 127)
    others = torch.cat([back[256:512], back[768:]]) - torch.cat([x[256:512], x[768:]])
    assert (
        float(others.abs().max())
        <= float(x[256:512].abs().max().clamp(min=x[768:].abs().max())) / 254 * SLACK
    )
    # The outlier's own block lost its small values to the coarse step, within the bound.
    assert float((back[512:768] - x[512:768]).abs().max()) <= 1e6 / 254 * SLACK


def test_non_finite_block_comes_back_nan_others_intact() -> None:
    x = torch.ones(768)
    x[10] = float("inf")
    x[300] = float("nan")
    back = _roundtrip(x, 256)
    assert bool(back[:256].isnan().all()) and bool(back[256:512].isnan().all())
    assert torch.equal(back[512:], x[512:])


def test_bf16_input_and_output() -> None:
    x = torch.randn(500, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    codec = BlockCodec(500, 128)
    wire = torch.empty(1, codec.nbytes, dtype=torch.uint8)
    codec.encode(x.view(1, -1), wire)
    out = torch.empty(1, 500, dtype=torch.bfloat16)
    codec.decode(wire, out)
    bound = _block_bound(x.float(), 128) + x.float().abs() * 2**-8  # + bf16's own rounding
    assert bool(((out.view(-1).float() - x.float()).abs() <= bound * SLACK).all())


@pytest.mark.parametrize(
    ("numel", "block_size"), [(0, 256), (1, 256), (3, 2), (256, 256), (257, 256)]
)
def test_payload_layout(numel: int, block_size: int) -> None:
    codec = BlockCodec(numel, block_size)
    blocks = math.ceil(numel / block_size)
    assert codec.blocks == blocks
    assert codec.nbytes % 4 == 0 and codec.scales_offset % 4 == 0
    assert codec.nbytes == codec.scales_offset + 4 * blocks >= numel + 4 * blocks
    # Rows laid end to end (one per rank) decode independently.
    rows = torch.randn(3, numel, generator=torch.Generator().manual_seed(1))
    wire = torch.empty(3, codec.nbytes, dtype=torch.uint8)
    codec.encode(rows, wire)
    out = torch.empty(3, numel)
    codec.decode(wire, out)
    for r in range(3):
        single = _roundtrip(rows[r], block_size)
        assert torch.equal(out[r], single)


def test_wire_size_is_about_a_quarter_of_fp32() -> None:
    codec = BlockCodec(1 << 20, 256)
    assert codec.nbytes / (4 << 20) == pytest.approx(0.2539, abs=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"weights": "int4"}, ValueError, "weights='int4'"),
        ({"gradients": "fp8"}, ValueError, "gradients='fp8'"),
        ({"block_size": 0}, ValueError, "at least 1"),
        ({"block_size": 2.5}, TypeError, "must be an int"),
    ],
)
def test_policy_refuses_bad_values(kwargs: dict[str, object], error: type, says: str) -> None:
    with pytest.raises(error, match=says):
        fsdp.QuantizedCommPolicy(**kwargs)  # type: ignore[arg-type]


def test_policy_defaults() -> None:
    policy = fsdp.QuantizedCommPolicy()
    assert (policy.weights, policy.gradients, policy.block_size) == ("int8", "int8", 64)


def test_front_ends_refuse_a_bad_comm_policy() -> None:
    """Checked before any process group is needed: the type error names the fix."""
    from torch import nn

    with pytest.raises(TypeError, match=r"comm_policy must be a fsdp.QuantizedCommPolicy"):
        fsdp.fully_shard(nn.Linear(2, 2), comm_policy="int8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"comm_policy must be a fsdp.QuantizedCommPolicy"):
        fsdp.FullyShardedDataParallel(nn.Linear(2, 2), comm_policy="int8")  # type: ignore[arg-type]


@pytest.mark.parametrize(("numel", "block_size"), [(0, 8), (5, 8), (64, 8), (1000, 256)])
def test_decode_sum_adds_the_rows_in_order(numel: int, block_size: int) -> None:
    codec = BlockCodec(numel, block_size)
    rows = torch.randn(4, numel, generator=torch.Generator().manual_seed(2))
    wire = torch.empty(4, codec.nbytes, dtype=torch.uint8)
    codec.encode(rows, wire)
    each = torch.empty(4, numel)
    codec.decode(wire, each)
    total = torch.full((numel,), float("nan"))
    codec.decode_sum(wire, total)
    expected = each[0] + each[1] + each[2] + each[3]
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-6)
    # A rank's own row enters exact, at its place in the order.
    own = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    codec.decode_sum(wire, total, exact=(2, own))
    expected = each[0] + each[1] + own + each[3]
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-6)


def _reference_payload(rows: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The format written out plainly: per row, padded blocks, ``absmax / 127`` scales and
    ``round(x * (1 / scale))`` codes (what [Note: block-wise quantization] specifies)."""
    r, n = rows.shape
    blocks = -(-n // block_size)
    padded = torch.nn.functional.pad(rows.float(), (0, blocks * block_size - n))
    padded = padded.view(r, blocks, block_size)
    scales = padded.abs().amax(dim=2) / 127.0
    inverse = torch.where(scales > 0, 1.0 / torch.where(scales > 0, scales, 1.0), 0.0)
    codes = (padded * inverse.unsqueeze(2)).round().to(torch.int8)
    return codes.view(r, -1), scales


@pytest.mark.parametrize("chunk", [1, 8, 300, 1 << 17])
@pytest.mark.parametrize(("numel", "block_size"), [(1, 4), (1000, 64), (4099, 256), (70_000, 3)])
def test_chunked_codec_equals_the_plain_format(
    numel: int, block_size: int, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The codec works through cache-sized chunks ([Note: codec passes]); however the
    blocks fall into chunks, the payload is the plain format's, bit for bit, and so are
    the decoded values (fp32, bf16) and the sums."""
    import fsdp._runtime._quantize as quantize

    monkeypatch.setattr(quantize, "_CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(numel + block_size)
    rows = torch.randn(3, numel, generator=g) * torch.logspace(-2, 2, numel)
    codec = BlockCodec(numel, block_size)
    wire = torch.full((3, codec.nbytes), 0xAB, dtype=torch.uint8)
    codec.encode(rows, wire)
    codes, scales = _reference_payload(rows, block_size)
    assert torch.equal(wire[:, : codec.codes_bytes].view(torch.int8), codes)
    assert torch.equal(wire[:, codec.scales_offset :].view(torch.float32), scales)
    values = (codes.view(3, -1, block_size).float() * scales.unsqueeze(2)).view(3, -1)[:, :numel]
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((3, numel), float("nan"), dtype=dtype)
        codec.decode(wire, out)
        assert torch.equal(out, values.to(dtype))
    total = torch.full((numel,), float("nan"))
    codec.decode_sum(wire, total, exact=(1, rows[1]))
    # Row 2 is added by a multiply-add, so the last bit (of the largest term) may differ.
    ulp = float(rows.abs().max()) * 2**-23
    torch.testing.assert_close(total, values[0] + rows[1] + values[2], rtol=0, atol=2 * ulp)
