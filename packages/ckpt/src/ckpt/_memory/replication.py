"""The background half of a snapshot: the replica to another machine, and the agreement.

[Note: a snapshot counts once both copies are in]
``save`` returns once this rank's own copy is committed in its machine's memory; a
thread then (on the snapshots' own gloo group, so it never meets the training loop's
collectives, as ``async_save``'s writer does not):

1. sends the data file and its descriptor to the partner rank on another machine
   ([Note: replicas on another machine]) and receives those it keeps for others,
   straight into their slot files (memory-mapped: no copy beside the kernel's);
2. commits each received replica by writing its descriptor after its data;
3. agrees with every rank (one all-reduce of the step, MIN) that the step is complete
   on both copies everywhere.

The next ``save`` waits for this first, and only then overwrites the slot of the step
before, so at every moment some complete step survives the loss of any one machine:
the one just agreed, whose both copies are in. A machine lost mid-snapshot leaves its
partner without the new replica, so that step is not recoverable, and the previous one
still is (its slots were not touched). After the first agreed step of a new generation,
the files of earlier generations are removed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckpt._memory.machine_folder import MachineFolder

__all__ = ["OwnCopy", "Replication"]


def _wait(works: list[Any]) -> None:
    for work in works:
        if work is not None:
            work.wait()


_SIZES, _DATA, _DESCRIPTOR = 1, 2, 3  # message tags


@dataclass(frozen=True)
class OwnCopy:
    """This rank's committed snapshot, to be replicated."""

    generation: str
    step: int
    rank: int
    data: Path
    data_bytes: int
    descriptor: bytes


def _mapped(path: Path, nbytes: int, *, writable: bool) -> torch.Tensor:
    """The first ``nbytes`` of ``path`` as a uint8 tensor over the file's pages."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=writable, size=nbytes, dtype=torch.uint8)


class Replication:
    """One snapshot's replication and agreement, on a thread (see the module docstring)."""

    own: OwnCopy
    agreed: bool  # every rank holds both copies of this step
    error: BaseException | None

    def __init__(
        self,
        own: OwnCopy,
        *,
        folder: MachineFolder,
        group: dist.ProcessGroup | None,
        partner: int | None,
        senders: list[int],
        on_agreed: Callable[[OwnCopy], None],
    ) -> None:
        self.own = own
        self.agreed = False
        self.error = None
        self._folder = folder
        self._group = group
        self._partner = partner
        self._senders = senders
        self._on_agreed = on_agreed
        self._thread = threading.Thread(
            target=self._run, name=f"ckpt-snapshot:{own.step}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def wait(self) -> None:
        """Block until done; re-raise what failed in the thread."""
        self._thread.join()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            if self._group is not None:
                self._exchange()
                step = torch.tensor([self.own.step], dtype=torch.int64)
                dist.all_reduce(step, op=dist.ReduceOp.MIN, group=self._group)
                if int(step) != self.own.step:
                    raise RuntimeError(f"ranks snapshot different steps ({int(step)})")
            self.agreed = True
            self._on_agreed(self.own)
        except BaseException as e:
            self.error = e

    def _exchange(self) -> None:
        own, group = self.own, self._group
        works: list[Any] = []
        if self._partner is not None:
            sizes = torch.tensor([own.data_bytes, len(own.descriptor)], dtype=torch.int64)
            works.append(dist.isend(sizes, self._partner, group=group, tag=_SIZES))
        incoming = {s: torch.empty(2, dtype=torch.int64) for s in self._senders}
        works += [dist.irecv(t, s, group=group, tag=_SIZES) for s, t in incoming.items()]
        _wait(works)
        works = []
        if self._partner is not None:
            data = _mapped(own.data, own.data_bytes, writable=False)
            descriptor = torch.frombuffer(bytearray(own.descriptor), dtype=torch.uint8)
            works.append(dist.isend(data, self._partner, group=group, tag=_DATA))
            works.append(dist.isend(descriptor, self._partner, group=group, tag=_DESCRIPTOR))
        received: list[tuple[int, int, torch.Tensor]] = []
        for sender, sizes in incoming.items():
            data_bytes, descriptor_bytes = (int(v) for v in sizes)
            slot = self._folder.slot(own.generation, sender)
            path = self._folder.begin(own.generation, sender, slot)
            with open(path, "a+b") as f:
                f.truncate(data_bytes)
            target = _mapped(path, data_bytes, writable=True)
            descriptor = torch.empty(descriptor_bytes, dtype=torch.uint8)
            works.append(dist.irecv(target, sender, group=group, tag=_DATA))
            works.append(dist.irecv(descriptor, sender, group=group, tag=_DESCRIPTOR))
            received.append((sender, slot, descriptor))
        _wait(works)
        for sender, slot, descriptor in received:
            self._folder.commit(own.generation, sender, slot, descriptor.numpy().tobytes())
