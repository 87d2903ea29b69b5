"""Ctrl-C as a request to stop at the next step boundary, agreed on by all ranks.

[Note: stopping together]
A signal reaches the ranks at different moments (or only one of them, if it is sent
to one process). Raising KeyboardInterrupt wherever it lands would leave one rank in
the middle of a step while the others wait in a collective for it. Instead, the
handler only sets a flag; every step all-reduces the flags together with the loss
(``Trainer.train_step``), so all ranks see the same decision after the same step, save
one checkpoint together and exit. torchrun forwards the signal it receives to the
workers, so a terminal's Ctrl-C arrives twice; only a third one forces an immediate
exit (without a checkpoint).

The program then exits with the shell's status for the first signal: 130 for SIGINT,
143 for SIGTERM (how schedulers preempt a job), after the checkpoint is committed.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType, TracebackType
from typing import Any

from .report import timestamped

_FORCE_AFTER = 3  # signals; see [Note: stopping together]


class StopRequest:
    """Turns SIGINT and SIGTERM into a flag while installed (a context manager)."""

    label: str  # printed before the message, e.g. "[rank 1] "
    signals_seen: int
    signal_name: str | None  # the first signal's name, for the exit message
    signum: int | None  # the first signal's number: the exit status is 128 + it
    _previous: dict[int, Any]

    def __init__(self, label: str = "") -> None:
        self.label = label
        self.signals_seen = 0
        self.signal_name = None
        self.signum = None
        self._previous = {}

    @property
    def requested(self) -> bool:
        """Whether this rank was asked to stop."""
        return self.signals_seen > 0

    def request(self, signum: int, frame: FrameType | None = None) -> None:
        """The signal handler (also callable directly)."""
        del frame
        self.signals_seen += 1
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self.signum = signum
        if self.signals_seen >= _FORCE_AFTER:
            raise KeyboardInterrupt(f"{self.signal_name} received {self.signals_seen} times")
        if self.signals_seen == 1:
            message = (
                f"{self.label}{self.signal_name}: stopping after this step, with a checkpoint "
                f"(press Ctrl-C {_FORCE_AFTER - 1} more times to quit without one)"
            )
            print(timestamped(message, sys.stderr.isatty()), file=sys.stderr, flush=True)

    def __enter__(self) -> StopRequest:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self.request)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
