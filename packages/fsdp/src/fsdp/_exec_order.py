"""The order in which units run, recorded once and used to pick prefetch targets.

Pure bookkeeping over opaque keys (the FSDP states), tested without a process
group. Prefetching needs to know, while unit ``u`` runs, which unit runs next:
- forward: the unit whose forward starts after ``u``'s starts (pre-forward order);
- backward: the unit whose backward comes after ``u``'s. Backward runs in the
  reverse of the order in which forwards *finish* (a parent finishes after its
  children), so the backward order is the reversed post-forward order.
Both are recorded during the first iteration that runs with gradients enabled
and frozen at the end of its backward ("static graph", as torch's FSDP assumes
for ``forward_prefetch``). A unit that runs twice in one iteration is recorded
once, at its first run.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["ExecOrder"]

K = TypeVar("K")


class ExecOrder(Generic[K]):
    """Pre-forward and post-forward order of the first iteration."""

    def __init__(self) -> None:
        self._pre_forward: dict[K, int] = {}  # key -> position in pre-forward order
        self._post_forward: dict[K, int] = {}  # key -> position in post-forward order
        self._pre_list: list[K] = []  # keys in the order their forward started
        self._post_list: list[K] = []  # keys in the order their forward finished
        self._frozen = False  # True once the first iteration's backward ended

    @property
    def frozen(self) -> bool:
        """Whether the order is final (recording stopped)."""
        return self._frozen

    def record_pre_forward(self, key: K) -> None:
        """``key``'s forward starts; recorded only during the first iteration."""
        if not self._frozen and key not in self._pre_forward:
            self._pre_forward[key] = len(self._pre_list)
            self._pre_list.append(key)

    def record_post_forward(self, key: K) -> None:
        """``key``'s forward ended; recorded only during the first iteration."""
        if not self._frozen and key not in self._post_forward:
            self._post_forward[key] = len(self._post_list)
            self._post_list.append(key)

    def freeze(self) -> None:
        """End of the first backward: the order is final from now on."""
        if self._post_forward:
            self._frozen = True

    def next_forward(self, key: K) -> K | None:
        """The unit whose forward follows ``key``'s, once the order is final."""
        if not self._frozen:
            return None
        i = self._pre_forward.get(key)
        if i is None or i + 1 >= len(self._pre_list):
            return None
        return self._pre_list[i + 1]

    def next_backward(self, key: K) -> K | None:
        """The unit whose backward follows ``key``'s.

        Usable already in the first iteration: by the time a backward runs,
        the forward that produced it has recorded its post-forward order.
        """
        i = self._post_forward.get(key)
        if i is None or i == 0:
            return None
        return self._post_list[i - 1]

    @property
    def forward_order(self) -> list[K]:
        """The recorded pre-forward order (a copy)."""
        return list(self._pre_list)
