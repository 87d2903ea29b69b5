"""The agreement step: do all ranks hold the same fingerprint? (one small all-to-all)

[Note: agreement step]
Where the ranks of a job must have built the same thing (fsdp at the root's lazy
initialisation, zero_optim at construction, ckpt at every save and load), each rank
describes what must match as a *fingerprint*: a flat ``{field: value}`` dict of
short strings. The package sends a digest of it to every rank in one small
all-to-all of fixed size (``all_to_all`` is a collective FSDP's training loop never
issues, so a rank that is one step ahead and still gathering parameters cannot pair
its message with ours; gloo aborts the process on a size mismatch within one kind
of collective). Only when the digests differ do the ranks exchange the
fingerprints themselves (a second all-to-all, padded to the longest) and every
rank raises the same :class:`RankDisagreementError` built by
:func:`disagreement_message`.

The protocol lives here, with the communication passed in as a function, so
that fsdp, zero_optim and ckpt share it while flatparam itself never uses
``torch.distributed``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from flatparam._rank_errors import RankDisagreementError, disagreement_message

__all__ = ["check_fingerprints_agree"]

HEADER_LEN = 3  # int64 per rank in the first all-to-all: the blob's length, a 16-byte digest


def check_fingerprints_agree(
    stage: str,
    fingerprint: Mapping[str, str],
    *,
    world_size: int,
    all_to_all: Callable[[Tensor, Tensor], None],
    device: torch.device,
    where: str,
    fixes: Mapping[str, str],
    default_fix: str,
) -> None:
    """Raise the same :class:`RankDisagreementError` on every rank if fingerprints differ.

    ``all_to_all(output, input)`` must be ``dist.all_to_all_single`` over the
    ranks that must agree (the caller wraps it to name backend failures);
    ``stage`` names the call site, so ranks at different points of the
    program are told so. Costs one all-to-all of ``HEADER_LEN`` int64 per
    rank when everything matches.
    """
    if world_size <= 1:
        return
    blob = _encode(stage, fingerprint)
    send = torch.tensor(_header(blob) * world_size, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    all_to_all(recv, send)
    rows = recv.view(world_size, HEADER_LEN).tolist()
    if all(row == rows[0] for row in rows):
        return
    # Every rank saw the same headers, so every rank takes this branch with the same size.
    longest = max(int(row[0]) for row in rows)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    send = mine.repeat(world_size).to(device)
    recv = torch.empty_like(send)
    all_to_all(recv, send)
    got = recv.cpu().view(world_size, longest)
    decoded = [_decode(bytes(got[r].tolist())) for r in range(world_size)]
    message, fields = disagreement_message(
        where, [d[0] for d in decoded], [d[1] for d in decoded], fixes, default_fix
    )
    raise RankDisagreementError(message, where=where, fields=fields)


def _encode(stage: str, fingerprint: Mapping[str, str]) -> bytes:
    """The bytes a rank sends in the agreement step (see [Note: agreement step])."""
    return json.dumps([stage, list(fingerprint.items())]).encode()  # keeps the field order


def _decode(blob: bytes) -> tuple[str, dict[str, str]]:
    """The ``(stage, fingerprint)`` another rank sent; inverse of :func:`_encode`."""
    stage, fingerprint = json.loads(blob.rstrip(b"\0").decode())
    return str(stage), {str(k): str(v) for k, v in fingerprint}


def _header(blob: bytes) -> list[int]:
    """The fixed-size summary of ``blob`` every rank compares first (``HEADER_LEN`` ints)."""
    digest = hashlib.blake2b(blob, digest_size=16).digest()
    return [
        len(blob),
        int.from_bytes(digest[:8], "little", signed=True),
        int.from_bytes(digest[8:], "little", signed=True),
    ]
