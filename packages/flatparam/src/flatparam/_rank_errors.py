"""The two errors every package raises when ranks of one job go different ways.

flatparam is the one package fsdp, zero_optim and ckpt all depend on, so the
classes live here and each package re-exports them: ``except fsdp.CollectiveError``
and ``except ckpt.CollectiveError`` catch the same class. Nothing here talks to
other ranks (flatparam never uses ``torch.distributed``): the packages exchange
the values, this module compares them and writes the message.
The agreement step that raises :class:`RankDisagreementError` is in ``_agreement.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

__all__ = [
    "CollectiveError",
    "RankDisagreementError",
    "disagreement_message",
    "named_backend_failures",
]

# How many differing fields a message lists before it says "and N more".
_MAX_FIELDS = 6


class RankDisagreementError(ValueError):
    """Ranks passed different values where every rank must pass the same.

    A ``ValueError``: the inputs (the model, the options, the path) are wrong,
    as when torch refuses mismatched arguments. Every rank raises it with the
    same message, naming each differing field, its value on every rank and
    the fix. ``fields`` maps each differing field to the per-rank values.
    """

    def __init__(self, message: str, *, where: str, fields: Mapping[str, Sequence[str]]) -> None:
        super().__init__(message)
        self.where = where
        self.fields = dict(fields)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_disagreement, (self.args[0], self.where, self.fields))


def _rebuild_disagreement(
    message: str, where: str, fields: Mapping[str, Sequence[str]]
) -> RankDisagreementError:
    return RankDisagreementError(message, where=where, fields=fields)


class CollectiveError(RuntimeError):
    """A collective inside fsdp, zero_optim or ckpt failed on this rank.

    Raised in place of the backend's error (a timeout, a connection reset by a
    peer that died, a peer in another collective), which is chained as
    ``__cause__``. The message starts with this rank, the operation, what it
    moved (a unit, a parameter bucket, a checkpoint) and the training phase
    (forward, backward, post-backward, optimizer step, save, load; ``""``
    while no caller has named it yet), so the first line of a crashed job's log
    says where each rank was.
    """

    def __init__(self, message: str, *, rank: int, operation: str, target: str, phase: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.operation = operation
        self.target = target
        self.phase = phase

    @classmethod
    def from_backend(
        cls, error: BaseException, *, rank: int, operation: str, target: str, phase: str
    ) -> CollectiveError:
        """The error for ``error`` raised by the backend; the caller chains it (``from``)."""
        backend = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        lowered = backend.lower()
        if "timed out" in lowered or "timeout" in lowered:
            why = (
                "the other ranks did not join it within the process group's timeout: one "
                "is in another collective (a different step, an extra forward, its own "
                "barrier) or stopped"
            )
        elif "reset by peer" in lowered or "closed by peer" in lowered or "broken pipe" in lowered:
            why = "a peer rank died or closed its connection (look at the other ranks' output)"
        else:
            why = "the backend failed"
        during = f" during {phase}" if phase else ""
        message = (
            f"rank {rank}: {operation} of {target} failed{during}: {why}. Backend error: {backend}"
        )
        return cls(message, rank=rank, operation=operation, target=target, phase=phase)

    @property
    def backend_error(self) -> BaseException:
        """The backend's own error this one was made from (itself if not chained)."""
        return self.__cause__ if self.__cause__ is not None else self

    def in_phase(self, phase: str, target: str) -> CollectiveError:
        """This failure renamed by an outer level that knows the phase and a fuller target.

        The inner level (the collective's wrapper) knows only the operation and the
        tensor; raise the result ``from`` :attr:`backend_error`, as the original was.
        """
        return CollectiveError.from_backend(
            self.backend_error, rank=self.rank, operation=self.operation, target=target, phase=phase
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_collective,
            (self.args[0], self.rank, self.operation, self.target, self.phase),
        )


def _rebuild_collective(
    message: str, rank: int, operation: str, target: str, phase: str
) -> CollectiveError:
    return CollectiveError(message, rank=rank, operation=operation, target=target, phase=phase)


def disagreement_message(
    where: str,
    stages: Sequence[str],
    fingerprints: Sequence[Mapping[str, str]],
    fixes: Mapping[str, str],
    default_fix: str,
) -> tuple[str, dict[str, list[str]]]:
    """The message (and per-field values) for ranks whose fingerprints differ.

    ``stages[r]`` names what rank ``r`` was doing (``"fsdp lazy init"``,
    ``"ckpt.save"``, ...); when they differ, that is the whole story (the ranks
    are at different points of the program). Otherwise each field whose value
    differs is listed with every rank's value, followed by the fix from
    ``fixes`` (by field name prefix) or ``default_fix``.
    """
    if len(set(stages)) > 1:
        per_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(stages))
        message = (
            f"{where}: the ranks are at different points of the program ({per_rank}). "
            "Every rank must make the same calls in the same order (the same number of "
            "steps, the same saves and loads); check the conditions that differ per rank."
        )
        return message, {"stage": list(stages)}
    names: list[str] = []
    for fp in fingerprints:
        names.extend(n for n in fp if n not in names)
    fields: dict[str, list[str]] = {}
    for name in names:
        values = [fp.get(name, "<missing>") for fp in fingerprints]
        if len(set(values)) > 1:
            fields[name] = values
    items = list(fields.items())
    first = "; ".join(f"rank {r}: {v}" for r, v in enumerate(items[0][1])) if items else ""
    head = f"{where}: the ranks disagree on {items[0][0]} ({first})" if items else where
    if len(items) > 1:
        head += f" and on {len(items) - 1} more setting(s)"
    lines = [head + "; every rank must pass the same."]
    used_fixes: list[str] = []
    for name, values in items[:_MAX_FIELDS]:
        shown = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        lines.append(f"  {name}: {shown}")
        fix = next((f for key, f in fixes.items() if name.startswith(key)), default_fix)
        if fix not in used_fixes:
            used_fixes.append(fix)
    if len(items) > _MAX_FIELDS:
        lines.append(f"  ... and {len(items) - _MAX_FIELDS} more")
    lines.append("Fix: " + " ".join(used_fixes))
    return "\n".join(lines), fields


@contextmanager
def named_backend_failures(
    rank: int | Callable[[], int], operation: str, target: str, phase: str = ""
) -> Iterator[None]:
    """Re-raise a backend ``RuntimeError`` inside the block as a :class:`CollectiveError`.

    The one translation every package's collectives go through, so a timeout or a
    dead peer reads the same whichever package met it. An error already named
    passes through unchanged. ``rank`` may be a function, called only on failure
    (asking the process group costs more than the block does when nothing fails).
    """
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:  # torch's DistError/DistBackendError derive from it
        who = rank() if callable(rank) else rank
        raise CollectiveError.from_backend(
            e, rank=who, operation=operation, target=target, phase=phase
        ) from e
