"""The order in which units run, recorded each iteration and used to pick prefetch targets.

Pure bookkeeping over opaque keys (the FSDP states), tested without a process
group. Prefetching needs to know, while unit ``u`` runs, which unit runs next:
- forward: the unit whose forward starts after ``u``'s starts (pre-forward order);
- backward: the unit whose backward comes after ``u``'s. Backward runs in the
  reverse of the order in which forwards *finish* (a parent finishes after its
  children), so the backward order is the reversed post-forward order.
A unit that runs twice is recorded once, at its first run.

[Note: forward order and its changes]
The forward order used to issue a unit's all-gather ahead of its turn is the
pre-forward order of the previous forward that ran with gradients enabled
(the first such forward issues nothing ahead: there is no order yet). Each
forward is checked against it as it runs (:meth:`ExecOrder.forward_step`):
the ``i``-th unit to start its forward must be the recorded ``i``-th. At the
first unit that differs (a conditional branch took another way, a unit was
skipped) the forward is *diverged*: nothing more is issued ahead until it
ends, and the units it runs gather on demand. At the end of the forward the
order just seen replaces the recorded one, so a branch that changes once
costs one forward without issue-ahead, not every forward after it.

Every rank must take the same decisions, or one rank issues an all-gather
that the others do not (a hang, or a wrong pairing of collectives). The
decisions depend only on the sequence of units whose forward starts, which
FSDP already needs to be the same on every rank (each such unit gathers);
they never depend on timing, on data or on what has finished. Nothing is
ever freed because of a divergence (a freed unit gathered again later would
be an extra collective on this rank only if another rank did not diverge):
a unit issued ahead but not run stays gathered until its forward runs or
the root's forward/backward ends, as any unused unit.

The backward order comes from the current iteration's forward (reset at
the end of each backward), so it is right whatever the previous iteration did.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["ExecOrder"]

K = TypeVar("K")


class ExecOrder(Generic[K]):
    """Pre-forward order of the last forward, post-forward order of the current iteration."""

    def __init__(self) -> None:
        self._recorded: list[K] = []  # pre-forward order of the last grad-enabled forward
        self._current: list[K] = []  # pre-forward order of the forward running now
        self._seen: set[K] = set()  # keys of ``_current``
        self._diverged = False  # the running forward left the recorded order
        self._post_forward: dict[K, int] = {}  # key -> position in post-forward order
        self._post_list: list[K] = []  # keys in the order their forward finished
        self.changes = 0  # how many forwards ended with another order than recorded

    # --- forward ---------------------------------------------------------------------------------

    def start_forward(self) -> None:
        """The root's forward starts: check the units against the recorded order afresh."""
        self._current = []
        self._seen = set()
        self._diverged = False

    def forward_step(self, key: K) -> K | None:
        """``key``'s forward starts; the unit to issue ahead of its turn, if any.

        ``None`` when ``key`` ran already in this forward, when there is no
        recorded order, when this forward has left it (see [Note: forward
        order and its changes]) or when ``key`` is the last recorded unit.
        """
        if key in self._seen:
            return None
        self._seen.add(key)
        i = len(self._current)
        self._current.append(key)
        if self._diverged:
            return None
        if i >= len(self._recorded) or self._recorded[i] != key:
            self._diverged = True
            return None
        return self._recorded[i + 1] if i + 1 < len(self._recorded) else None

    def end_forward(self, record: bool) -> bool:
        """The root's forward ended; keep its order if ``record``. Whether it changed.

        A forward that ran fewer units than recorded has changed too.
        """
        changed = self._diverged or len(self._current) != len(self._recorded)
        if record and self._current and changed:
            if self._recorded:
                self.changes += 1
            self._recorded = self._current
        self._current = []
        self._seen = set()
        self._diverged = False
        return changed

    @property
    def diverged(self) -> bool:
        """Whether the running forward has left the recorded order."""
        return self._diverged

    @property
    def forward_order(self) -> list[K]:
        """The recorded pre-forward order (a copy)."""
        return list(self._recorded)

    # --- backward --------------------------------------------------------------------------------

    def record_post_forward(self, key: K) -> None:
        """``key``'s forward ended (with gradients enabled)."""
        if key not in self._post_forward:
            self._post_forward[key] = len(self._post_list)
            self._post_list.append(key)

    def end_backward(self) -> None:
        """The backward ended: the next iteration's forward records the post-forward order anew."""
        self._post_forward = {}
        self._post_list = []

    def next_backward(self, key: K) -> K | None:
        """The unit whose backward follows ``key``'s in this iteration."""
        i = self._post_forward.get(key)
        if i is None or i == 0:
            return None
        return self._post_list[i - 1]
