"""FlatParameter: many parameters stored as one 1-D tensor, and its metadata.

[Note: flat parameter views]
A FlatParameter holds the original parameters ``p_0 .. p_{n-1}`` concatenated
in order, each flattened in row-major (logical) order whatever its strides:

    flat[offset_i : offset_i + numel_i]  ==  p_i.reshape(-1)
    offset_i = numel_0 + ... + numel_{i-1}
    _param_offsets[i] = (offset_i, offset_i + numel_i - 1)   # end inclusive, as in the seed

``get_param_views()`` returns ``flat[offset_i : offset_i + numel_i].view(shape_i)``.
These views alias the flat storage: a write through a view is a write to the
flat tensor and vice versa, and an optimizer that steps the flat tensor steps
every original parameter. Made in grad mode from the FlatParameter itself,
the views carry autograd history back to it, so gradients of anything computed
from them accumulate in ``flat.grad`` (one tensor, laid out like ``flat``).

All views come from one ``split``, so backward writes ``flat.grad`` with one
concatenation rather than one full-size gradient per parameter. The price is an
autograd rule for multi-output views: once the flat tensor is changed in place
(an optimizer step), using an older view in grad mode raises "... has been
modified inplace"; take fresh views instead.

A view is also tied to the storage it was made from. Anything that swaps that
storage (``flat.data = ...`` when sharding, ``module.to()``) leaves old views
pointing at the old storage. For both reasons FlattenParamsWrapper remakes the
views before every forward and after ``_apply``.

[Note: seed shard metadata]
``shard_by_offsets(start, end, num_padded)`` records which slices of which
original parameters one rank's shard holds, in the seed's inclusive form:
``start``/``end`` bound the shard in the padded flat tensor (both inclusive, so
the shard has ``end - start + 1`` elements) and ``num_padded`` of those are
padding at its end (see [Note: padding] in ``flatparam._shard``). It only records
metadata; the caller decides what ``flat.data`` holds. ``apply_shard_layout``
does the same from a :class:`~flatparam.ShardLayout`. Parameters with no
elements in the shard (zero-numel ones included) are left out of
``shard_metadata()``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from flatparam._shard import ShardLayout

__all__ = [
    "FlatParameter",
    "ParamInfo",
    "ParamOffset",
    "ShardMetadata",
    "SharedParamInfo",
]

ParamOffset = tuple[int, int]
"""An inclusive ``(start, end)`` element range, as in the seed."""


class ParamInfo(NamedTuple):
    """Where one flattened parameter lived: ``module.<param_name>``.

    ``module_name`` is the module's name relative to the flattened root module
    (``""`` for the root), so the parameter's name is
    ``f"{module_name}.{param_name}"`` (or ``param_name`` at the root).
    """

    module_name: str
    module: nn.Module
    param_name: str


class SharedParamInfo(NamedTuple):
    """A second name for a parameter that is already flattened (tied weights).

    ``module.<param_name>`` is the same Parameter as
    ``prim_module.<prim_param_name>``, whose data the FlatParameter holds once;
    the alias is restored as the primary's view. Field order follows the seed's
    6-tuple, so ``for _, _, m, n, pm, pn in infos`` keeps working.
    """

    module_name: str
    prim_module_name: str
    module: nn.Module
    param_name: str
    prim_module: nn.Module
    prim_param_name: str


class ShardMetadata(NamedTuple):
    """The original parameters (or slices of them) that one shard holds.

    Entry ``k`` is a parameter of name ``param_names[k]`` and shape
    ``param_shapes[k]`` of which the shard holds
    ``param.reshape(-1)[param_offsets[k][0] : param_offsets[k][1] + 1]``
    (inclusive end, as in the seed).
    """

    param_names: list[str]
    param_shapes: list[torch.Size]
    param_numels: list[int]
    param_offsets: list[ParamOffset]


def _describe(i: int, t: Tensor) -> str:
    return f"params[{i}] (shape {tuple(t.shape)})"


def _group(values: Sequence[object], labels: Sequence[str]) -> str:
    groups: dict[str, list[str]] = {}
    for value, label in zip(values, labels, strict=True):
        groups.setdefault(str(value), []).append(label)
    return "; ".join(f"{value}: {', '.join(names[:8])}" for value, names in groups.items())


def _check_uniform(tensors: Sequence[Tensor], labels: Sequence[str], owner: str) -> None:
    """Refuse a mix of dtypes, devices or requires_grad, naming each group.

    One FlatParameter is one tensor: it has one dtype and one device (FSDP
    all-gathers it as a whole) and one requires_grad flag (autograd either
    tracks it or not). Concatenating a mix would silently promote or drop.
    """
    checks: list[tuple[str, list[object], str]] = [
        (
            "dtype",
            [t.dtype for t in tensors],
            "cast them to one dtype first, e.g. module.to(dtype)",
        ),
        (
            "device",
            [t.device for t in tensors],
            "move them to one device first, e.g. module.to(device)",
        ),
        (
            "requires_grad",
            [t.requires_grad for t in tensors],
            "set one requires_grad for all of them, or flatten the frozen ones separately",
        ),
    ]
    for what, values, fix in checks:
        if len(set(values)) > 1:
            raise ValueError(
                f"{owner} needs every parameter to have the same {what} (a FlatParameter is one "
                f"tensor), got {_group(values, labels)}; {fix}"
            )


def _rebuild_flat_param(data: Tensor, requires_grad: bool, state: dict[str, Any]) -> FlatParameter:
    """Unpickle a FlatParameter: its data, flag and metadata (``__reduce_ex__``)."""
    flat = FlatParameter._from_flat_data(data, requires_grad)
    flat.__dict__.update(state)
    return flat


class FlatParameter(nn.Parameter):
    """Many parameters as one flat 1-D parameter, with views back to them.

    Sharded data parallelism moves, all-gathers and reduce-scatters parameters
    as one tensor per module; one optimizer entry per flat tensor is also far
    cheaper than one per weight. The layout and the aliasing rules are in
    [Note: flat parameter views] in this module.

    Args:
        params: the parameters (or tensors) to flatten, in order; all of one
            dtype, device and requires_grad. Not modified: the flat tensor is a
            copy, and :class:`~flatparam.FlattenParamsWrapper` is what swaps the
            originals for views of it.
        requires_grad: whether the flat parameter needs gradients.

    Raises:
        ValueError: ``params`` is empty or not a list/tuple, holds a non-tensor
            or a FlatParameter, or mixes dtypes, devices or requires_grad.
    """

    # Metadata, one entry per original parameter i, in flat order.
    _param_numels: list[int]  # numel_i
    _param_shapes: list[torch.Size]  # shape_i
    _param_offsets: list[ParamOffset]  # (offset_i, offset_i + numel_i - 1), inclusive
    _param_infos: list[ParamInfo]  # set by the wrapper: where p_i lived
    _shared_param_infos: list[SharedParamInfo]  # set by the wrapper: aliases of some p_i
    full_numel: int  # sum(numel_i): the unsharded, unpadded length
    # Shard metadata (see [Note: seed shard metadata]).
    _is_sharded: bool
    _param_indice_in_shard: tuple[int, int]  # (first, last) index in the shard, inclusive
    _sharded_param_indices: list[int]  # indices of the params with elements in the shard
    _sharded_param_offsets: list[ParamOffset]  # inclusive slice of each of those params
    num_padded: int  # padding elements at the end of this shard
    shard_layout: ShardLayout | None  # set by apply_shard_layout, else None
    shard_rank: int | None  # the rank apply_shard_layout was given, else None

    def __new__(
        cls, params: Sequence[Tensor] | Tensor, requires_grad: bool = True
    ) -> FlatParameter:
        tensors = cls._check_params(params)
        data = torch.cat([t.detach().reshape(-1) for t in tensors])
        return cls._from_flat_data(data, requires_grad)

    @classmethod
    def _from_flat_data(cls, data: Tensor, requires_grad: bool) -> FlatParameter:
        return torch.Tensor._make_subclass(cls, data, requires_grad)

    @staticmethod
    def _check_params(params: Sequence[Tensor] | Tensor) -> list[Tensor]:
        # A lone tensor is taken as already flat data (how copy and pickle
        # rebuild a Parameter subclass: type(self)(data, requires_grad)).
        if isinstance(params, Tensor):
            return [params]
        if not isinstance(params, (list, tuple)) or len(params) == 0:
            raise ValueError(
                "FlatParameter needs a non-empty list or tuple of parameters, got "
                f"{params!r:.80}; for a module with no parameters, use no FlatParameter "
                "(FlattenParamsWrapper(module, []) does that)"
            )
        not_tensors = [
            (i, type(p).__name__) for i, p in enumerate(params) if not isinstance(p, Tensor)
        ]
        if not_tensors:
            raise ValueError(
                f"FlatParameter needs Parameters or Tensors, got {not_tensors} (index, type)"
            )
        nested = [i for i, p in enumerate(params) if isinstance(p, FlatParameter)]
        if nested:
            raise ValueError(
                f"Nesting FlatParameter is not supported: params{nested} are FlatParameters; "
                "flatten their original parameters instead"
            )
        labels = [_describe(i, p) for i, p in enumerate(params)]
        _check_uniform(list(params), labels, "FlatParameter")
        return list(params)

    def __init__(self, params: Sequence[Tensor] | Tensor, requires_grad: bool = True) -> None:
        tensors = [params] if isinstance(params, Tensor) else list(params)
        self._param_numels = [t.numel() for t in tensors]
        self._param_shapes = [t.size() for t in tensors]
        self.full_numel = sum(self._param_numels)
        self._param_offsets = []
        start = 0
        for n in self._param_numels:
            self._param_offsets.append((start, start + n - 1))
            start += n
        self._param_infos = []
        self._shared_param_infos = []
        self._reset_shard_metadata()

    def _reset_shard_metadata(self) -> None:
        """Back to "this rank holds everything": every parameter, whole."""
        self._set_shard(
            list(range(len(self._param_numels))),
            [(0, n - 1) for n in self._param_numels],
            num_padded=0,
        )
        self._is_sharded = False

    def _set_shard(self, indices: list[int], offsets: list[ParamOffset], num_padded: int) -> None:
        self._is_sharded = True
        self._sharded_param_indices = indices
        self._sharded_param_offsets = offsets
        # An empty shard is the empty inclusive range (0, -1), as the seed's slice logic expects.
        self._param_indice_in_shard = (indices[0], indices[-1]) if indices else (0, -1)
        self.num_padded = num_padded
        self.shard_layout = None
        self.shard_rank = None

    # --- copying --------------------------------------------------------------------------

    def __deepcopy__(self, memo: dict[int, Any]) -> FlatParameter:
        if id(self) in memo:
            copied: FlatParameter = memo[id(self)]
            return copied
        new = FlatParameter._from_flat_data(
            self.data.clone(memory_format=torch.preserve_format), self.requires_grad
        )
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __reduce_ex__(self, proto: object) -> Any:
        # nn.Parameter's own reduce rebuilds a plain Parameter and would lose the
        # subclass and the metadata.
        return (_rebuild_flat_param, (self.data, self.requires_grad, dict(self.__dict__)))

    # --- sharding metadata (see [Note: seed shard metadata]) ------------------------------

    def shard_by_offsets(self, start: int, end: int, num_padded: int) -> None:
        """Record that this rank's shard is ``padded_flat[start : end + 1]``.

        The seed's entry point, kept for code written against it; ``end`` is
        inclusive and the last ``num_padded`` elements of the shard are padding.
        New code can use :meth:`apply_shard_layout`, which derives all three
        from a :class:`~flatparam.ShardLayout`.

        Raises:
            ValueError: a negative or reversed range, more padding than the
                shard holds, or too little padding to cover the part of the
                shard that lies past ``full_numel``.
        """
        if start < 0 or end < 0 or end < start:
            raise ValueError(
                f"Shard the flatten parameter with an invalid offset pair {(start, end)}: "
                "need 0 <= start <= end (end is inclusive)"
            )
        shard_size = end - start + 1
        if not 0 <= num_padded <= shard_size:
            raise ValueError(
                f"The number of padding ({num_padded}) is larger than the shard size "
                f"({shard_size} = end {end} - start {start} + 1) or negative"
            )
        past_end = end + 1 - max(start, self.full_numel)
        if num_padded < past_end:
            raise ValueError(
                f"The shard {(start, end)} runs {past_end} elements past full_numel "
                f"{self.full_numel}, but num_padded is {num_padded}; those elements can "
                "only be padding (pass num_padded >= the overrun)"
            )
        indices: list[int] = []
        offsets: list[ParamOffset] = []
        for i, (p_start, p_end) in enumerate(self._param_offsets):
            lo, hi = max(start, p_start), min(end, p_end)  # both inclusive
            if lo <= hi:
                indices.append(i)
                offsets.append((lo - p_start, hi - p_start))
        self._set_shard(indices, offsets, num_padded)

    def layout_for(self, world_size: int, align_numel: int = 1) -> ShardLayout:
        """The :class:`~flatparam.ShardLayout` of this flat parameter over ``world_size`` ranks."""
        return ShardLayout.build(self._param_numels, world_size, align_numel)

    def apply_shard_layout(self, layout: ShardLayout, rank: int) -> None:
        """Make :meth:`shard_metadata` describe ``rank``'s chunk under ``layout``.

        Metadata only: ``self.data`` is not touched (assign
        ``flatparam.shard_flat(...)`` to it if this rank should hold just its
        chunk). The layout and rank are kept in ``shard_layout``/``shard_rank``.

        Raises:
            ValueError: the layout was built for other parameter sizes, or the
                rank is out of range.
        """
        if layout.numels != tuple(self._param_numels):
            raise ValueError(
                f"apply_shard_layout: the layout was built for numels {layout.numels[:8]} "
                f"but this FlatParameter holds {tuple(self._param_numels[:8])}; build it with "
                "flat_param.layout_for(world_size, align_numel)"
            )
        pieces = layout.pieces(rank)
        self._set_shard(
            [p.param_index for p in pieces],
            [(p.param_start, p.param_end - 1) for p in pieces],
            layout.num_padded(rank),
        )
        self.shard_layout = layout
        self.shard_rank = rank

    def shard_for_rank(self, rank: int, world_size: int, align_numel: int = 1) -> ShardLayout:
        """:meth:`layout_for` then :meth:`apply_shard_layout`; returns the layout."""
        layout = self.layout_for(world_size, align_numel)
        self.apply_shard_layout(layout, rank)
        return layout

    # --- views and metadata ---------------------------------------------------------------

    def get_param_views(self, external_data: Tensor | None = None) -> Iterator[Tensor]:
        """Views of the original parameters into this flat tensor (or ``external_data``).

        ``external_data`` is any 1-D tensor of ``full_numel`` elements laid out
        like this one (an all-gathered buffer, a low-precision copy, a
        gradient): the views then alias it instead. See
        [Note: flat parameter views].

        Raises:
            ValueError: the data is not 1-D or does not hold ``full_numel``
                elements (e.g. this FlatParameter is sharded and no full
                ``external_data`` was given).
        """
        data: Tensor = self if external_data is None else external_data
        source = "this FlatParameter" if external_data is None else "external_data"
        if data.dim() != 1 or data.numel() != self.full_numel:
            raise ValueError(
                f"Incorrect numel of supplied data: {source} has shape {tuple(data.shape)} but "
                f"the views need a 1-D tensor of full_numel = {self.full_numel} elements; if "
                "the flat parameter is sharded, pass the gathered data as external_data"
            )
        return (
            t.view(s)
            for t, s in zip(data.split(self._param_numels), self._param_shapes, strict=True)
        )

    @property
    def _num_unflattened_params(self) -> int:
        """Number of original parameters (aliases not counted); set by the wrapper."""
        if not self._param_infos:
            raise RuntimeError(
                "`_param_infos` has not been set, meaning this `FlatParameter` has not been "
                "initialized by a FlattenParamsWrapper yet"
            )
        return len(self._param_infos)

    @property
    def param_info(self) -> list[ParamInfo]:
        """Where each original parameter lived, in flat order (empty until a wrapper sets it)."""
        return self._param_infos

    @property
    def shared_param_info(self) -> list[SharedParamInfo]:
        """The aliases (tied parameters) restored as views of a primary parameter."""
        return self._shared_param_infos

    @property
    def _param_names(self) -> list[str]:
        return [f"{m}.{n}" if m else n for m, _, n in self._param_infos]

    @property
    def _shared_param_names(self) -> list[tuple[str, str]]:
        """``(alias name, primary name)`` for each shared parameter."""
        return [
            (f"{m}.{n}" if m else n, f"{pm}.{pn}" if pm else pn)
            for m, pm, _, n, _, pn in self._shared_param_infos
        ]

    def metadata(self) -> tuple[list[str], list[torch.Size], list[int]]:
        """``(names, shapes, numels)`` of the original parameters, in flat order.

        Names are relative to the flattened module and are empty until a
        :class:`~flatparam.FlattenParamsWrapper` sets ``_param_infos``.
        """
        return self._param_names, list(self._param_shapes), list(self._param_numels)

    def shard_metadata(self) -> ShardMetadata:
        """What this rank's shard holds (see [Note: seed shard metadata]).

        Before any sharding call it describes every parameter, whole.
        """
        names = self._param_names
        idx = self._sharded_param_indices
        return ShardMetadata(
            [names[i] for i in idx] if names else [],
            [self._param_shapes[i] for i in idx],
            [self._param_numels[i] for i in idx],
            list(self._sharded_param_offsets),
        )
