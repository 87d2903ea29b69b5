"""FlattenParamsWrapper: a module whose parameters live in one FlatParameter.

[Note: wrapper states]
The wrapper is in one of two states:

- flattened (the normal one): ``flat_param`` is a registered FlatParameter and
  each flattened ``module.<name>`` is a plain attribute holding a view into it
  (see [Note: flat parameter views] in ``flatparam._flat_param``). Only
  ``flat_param`` shows up in ``parameters()``.
- unflattened (inside ``unflatten_params()``): ``flat_param`` is None, the
  original names are registered Parameters again (aliasing the flat storage,
  in their original order), and ``orig_flat_param[0]`` keeps the FlatParameter.

[Note: state dict keys]
``state_dict()`` of the wrapper equals the unwrapped module's in keys, key
order, values and ``_metadata``: the ``_fpw_module.`` level disappears and each
flattened parameter is saved under its original name (tied names included) as
a view of the flat storage, detached unless ``keep_vars``. ``load_state_dict()``
takes the same keys, so a state dict moves freely between the wrapped and the
unwrapped module. A sharded flat parameter (``numel() < full_numel``) cannot be
cut into original parameters, so it is saved as the seed did, under
``flat_param``; that key is also accepted when loading.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from flatparam._flat_param import FlatParameter, ParamInfo, SharedParamInfo, _check_uniform

__all__ = ["FLAT_PARAM", "FPW_MODULE", "FlattenParamsWrapper"]

FLAT_PARAM = "flat_param"
FPW_MODULE = "_fpw_module"


def _join(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name


def _drop(module: nn.Module, name: str) -> None:
    """Remove ``module.<name>`` whether it is a registered Parameter or a plain view."""
    module._parameters.pop(name, None)
    module.__dict__.pop(name, None)


def _post_state_dict_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    if not isinstance(module, FlattenParamsWrapper):
        raise TypeError(f"flatparam's state dict hook is for FlattenParamsWrapper, got {module!r}")
    module._rewrite_state_dict(state_dict, prefix)


def _post_load_state_dict_hook(module: nn.Module, incompatible_keys: Any) -> None:
    # Keys reported missing/unexpected by the wrapped modules carry the internal
    # level; report them under the names the caller used (see [Note: state dict keys]).
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [k.replace(FPW_MODULE + ".", "") for k in keys]


class FlattenParamsWrapper(nn.Module):
    """Wrap ``module`` so the parameters in ``param_list`` live in one FlatParameter.

    The wrapped module computes exactly what it computed before (its weights
    are views of the flat tensor, see [Note: flat parameter views]), while
    ``parameters()`` yields one tensor that a sharding runtime can move,
    all-gather or reduce-scatter as a whole. Attribute and index access fall
    through to ``module``; ``state_dict()``/``load_state_dict()`` use the
    unwrapped module's keys (see [Note: state dict keys]).

    Parameters are flattened in ``module.named_modules()`` order, each module's
    own parameters in registration order. A Parameter reachable under several
    names (tied weights) is stored once and every name gets the same view.

    Args:
        module: the module to wrap.
        param_list: the parameters to flatten, all of one dtype, device and
            requires_grad; others stay ordinary parameters of ``module``. An
            empty list wraps without a flat parameter (``flat_param is None``).

    Raises:
        TypeError: an item of ``param_list`` is not an ``nn.Parameter``.
        ValueError: an item is not a parameter of ``module``, or the
            parameters mix dtypes, devices or requires_grad (the message
            lists the parameter names grouped by value).
    """

    # See [Note: wrapper states].
    flat_param: FlatParameter | None  # registered; None when empty or unflattened
    orig_flat_param: list[FlatParameter | None]  # [the FlatParameter] while unflattened
    no_params: bool  # True when param_list was empty: never a flat_param
    param_set: set[tuple[nn.Module, str]]  # every (module, name) that was flattened
    # Original `_parameters` key order of each module that lost parameters,
    # so that unflattening and state dicts restore it.
    _param_order: dict[nn.Module, list[str]]
    _state_dict_keep_vars: bool  # keep_vars of the state_dict() call in progress

    def __init__(self, module: nn.Module, param_list: Iterable[Tensor]) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"FlattenParamsWrapper wraps an nn.Module, got {type(module).__name__}; pass "
                "the module whose parameters param_list holds"
            )
        super().__init__()
        self._fpw_module = module
        self.register_parameter(FLAT_PARAM, None)
        self.orig_flat_param = [None]
        self.no_params = True
        self.param_set = set()
        self._param_order = {}
        self._state_dict_keep_vars = False
        # The hooks apply even without a flat parameter: the `_fpw_module.`
        # level must vanish from every key either way.
        self._register_state_dict_hook(_post_state_dict_hook)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_post_hook(_post_load_state_dict_hook)  # type: ignore[no-untyped-call]

        wanted = list(param_list)
        if not wanted:
            return
        not_params = [
            (i, type(p).__name__) for i, p in enumerate(wanted) if not isinstance(p, nn.Parameter)
        ]
        if not_params:
            raise TypeError(
                f"FlattenParamsWrapper's param_list must hold nn.Parameters, got {not_params} "
                "(index, type); pass e.g. list(module.parameters())"
            )
        params, param_infos, shared_param_infos = self._init_flatten_params(
            [p for p in wanted if isinstance(p, nn.Parameter)]
        )
        self.no_params = False
        self.flat_param = FlatParameter(params, params[0].requires_grad)
        self.flat_param._param_infos = param_infos
        self.flat_param._shared_param_infos = shared_param_infos
        self._flatten_params()

    @property
    def module(self) -> nn.Module:
        """The wrapped module (``.module``, as on DDP and FSDP)."""
        return self._fpw_module

    def _init_flatten_params(
        self, wanted: list[nn.Parameter]
    ) -> tuple[list[nn.Parameter], list[ParamInfo], list[SharedParamInfo]]:
        """Find the wanted parameters in the module tree; refuse what cannot be flattened."""
        wanted_ids = {id(p) for p in wanted}
        first_seen: dict[int, tuple[str, nn.Module, str]] = {}
        params: list[nn.Parameter] = []
        param_infos: list[ParamInfo] = []
        shared_param_infos: list[SharedParamInfo] = []
        for module_name, m in self._fpw_module.named_modules():
            # _parameters, not named_parameters(): the latter hides a second name
            # for the same Parameter on one module, which would then keep stale data.
            for n, p in m._parameters.items():
                if p is None or id(p) not in wanted_ids:
                    continue
                self.param_set.add((m, n))
                self._param_order.setdefault(m, list(m._parameters))
                if id(p) in first_seen:
                    prim_name, prim_m, prim_n = first_seen[id(p)]
                    shared_param_infos.append(
                        SharedParamInfo(module_name, prim_name, m, n, prim_m, prim_n)
                    )
                else:
                    first_seen[id(p)] = (module_name, m, n)
                    param_infos.append(ParamInfo(module_name, m, n))
                    params.append(p)
        foreign = [f"shape {tuple(p.shape)}" for p in wanted if id(p) not in first_seen]
        if foreign:
            raise ValueError(
                f"FlattenParamsWrapper: {len(foreign)} parameter(s) in param_list are not "
                f"parameters of the wrapped module ({', '.join(foreign[:8])}); pass only "
                "parameters of the module you wrap"
            )
        labels = [_join(mn, n) for mn, _, n in param_infos]
        _check_uniform(params, labels, "FlattenParamsWrapper")
        return params, param_infos, shared_param_infos

    # --- flattening and unflattening (see [Note: wrapper states]) -------------------------

    def _flatten_params(self, external_data: FlatParameter | None = None) -> None:
        """Enter the flattened state: register the flat parameter, views in place of the originals.

        With ``external_data`` (the FlatParameter kept by ``unflatten_params``),
        values written to the registered originals while unflattened are kept:
        a Parameter that was replaced rather than updated in place is copied
        into the flat storage first.
        """
        if external_data is not None:
            self._copy_back_replaced(external_data)
            self.flat_param = external_data
        flat = self.flat_param
        if flat is None:
            raise RuntimeError(
                "Can not flatten params when both flat_param and external_data are None"
            )
        for info in flat._param_infos:
            _drop(info.module, info.param_name)
        for shared in flat._shared_param_infos:
            _drop(shared.module, shared.param_name)
        self._unflatten_params_as_views()

    def _copy_back_replaced(self, flat: FlatParameter) -> None:
        with torch.no_grad():
            views = list(flat.get_param_views())
            targets = [(i.module, i.param_name, views[k]) for k, i in enumerate(flat._param_infos)]
            index = {(id(i.module), i.param_name): k for k, i in enumerate(flat._param_infos)}
            for s in flat._shared_param_infos:
                targets.append(
                    (s.module, s.param_name, views[index[(id(s.prim_module), s.prim_param_name)]])
                )
            for m, n, view in targets:
                current = m._parameters.get(n)
                if current is None or (
                    current.data_ptr() == view.data_ptr() and current.shape == view.shape
                ):
                    continue
                if current.numel() != view.numel():
                    raise ValueError(
                        f"unflatten_params: {type(m).__name__}.{n} was replaced by a tensor of "
                        f"shape {tuple(current.shape)}, but the flat parameter holds shape "
                        f"{tuple(view.shape)} for it; parameters cannot change shape"
                    )
                view.copy_(current.detach().reshape(view.shape))

    def _unflatten_params_as_views(self) -> None:
        """Point every flattened name at a fresh view of ``flat_param``; ``flat_param`` unchanged.

        Fresh views carry autograd history from the current grad mode and alias
        the current storage (see [Note: flat parameter views]).
        """
        flat = self.flat_param
        if flat is None:
            raise RuntimeError("Can not unflatten params as views when flat_param is None")
        for info, view in zip(flat._param_infos, self._get_param_views(), strict=True):
            setattr(info.module, info.param_name, view)  # a plain attribute
        for s in flat._shared_param_infos:
            setattr(s.module, s.param_name, getattr(s.prim_module, s.prim_param_name))

    def _unflatten_params(self) -> None:
        """Enter the unflattened state: originals registered again, ``flat_param`` None."""
        flat = self.flat_param
        if flat is None:
            raise RuntimeError("Can not unflatten params when flat_param is None")
        with torch.no_grad():
            views = list(flat.get_param_views())
        for info, view in zip(flat._param_infos, views, strict=True):
            _drop(info.module, info.param_name)
            info.module.register_parameter(
                info.param_name, nn.Parameter(view, requires_grad=flat.requires_grad)
            )
        for s in flat._shared_param_infos:
            _drop(s.module, s.param_name)
            s.module.register_parameter(s.param_name, s.prim_module._parameters[s.prim_param_name])
        for m, order in self._param_order.items():
            current = dict(m._parameters)
            m._parameters.clear()
            for n in [*order, *current]:
                if n in current and n not in m._parameters:
                    m._parameters[n] = current[n]
        self.flat_param = None

    @contextlib.contextmanager
    def unflatten_params(self) -> Iterator[None]:
        """Give the wrapped module its original Parameters back for the block.

        For code that must see ordinary parameters (``named_parameters()`` of
        the inner module, a plain ``state_dict`` of it, an initializer). The
        Parameters alias the flat storage, so in-place changes persist;
        Parameters replaced in the block are copied back on exit. Nests
        harmlessly: if already unflattened, stays so.
        """
        if self.flat_param is None:
            yield
            return
        self.orig_flat_param[0] = self.flat_param
        self._unflatten_params()
        try:
            yield
        finally:
            flat = self.orig_flat_param[0]
            self.orig_flat_param[0] = None
            self._flatten_params(flat)

    def _get_param_views(self, external_data: Tensor | None = None) -> Iterator[Tensor]:
        if self.flat_param is None:
            raise RuntimeError("flat_param is None: nothing to take views of")
        return self.flat_param.get_param_views(external_data)

    def _unflatten_params_if_needed(self) -> None:
        if self.flat_param is not None:
            self._unflatten_params_as_views()

    # --- nn.Module plumbing ---------------------------------------------------------------

    def forward(self, *inputs: Any, **kwinputs: Any) -> Any:
        """Run the wrapped module on fresh views (see [Note: flat parameter views])."""
        self._unflatten_params_if_needed()
        return self.module(*inputs, **kwinputs)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> FlattenParamsWrapper:
        # .to()/.half()/... swap flat_param's storage; the views must follow it.
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        orig = self.orig_flat_param[0]
        if self.flat_param is None and orig is not None:
            # Unflattened: the registered originals were converted; convert the
            # kept FlatParameter too so that leaving unflatten_params() copies
            # them back into storage of the new dtype/device.
            with torch.no_grad():
                orig.data = fn(orig)
        self._unflatten_params_if_needed()
        return self

    def __getattr__(self, name: str) -> Any:
        """Forward missing attributes to the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == FPW_MODULE:  # not set yet: don't recurse through self.module
                raise
            return getattr(self._fpw_module, name)

    def __getitem__(self, key: Any) -> Any:
        """Forward indexing, for a wrapped ``nn.Sequential`` or ``nn.ModuleList``."""
        inner: Any = self._fpw_module
        return inner[key]

    def __deepcopy__(self, memo: dict[int, Any]) -> FlattenParamsWrapper:
        # The views on the inner modules are non-leaf tensors, which deepcopy
        # refuses; copy without them and make fresh views on both sides.
        flat = self.flat_param
        if flat is not None:
            for info in flat._param_infos:
                _drop(info.module, info.param_name)
            for s in flat._shared_param_infos:
                _drop(s.module, s.param_name)
        try:
            new = self.__class__.__new__(self.__class__)
            memo[id(self)] = new
            for key, value in self.__dict__.items():
                new.__dict__[key] = copy.deepcopy(value, memo)
        finally:
            self._unflatten_params_if_needed()
        new._unflatten_params_if_needed()
        return new

    # --- state dict (see [Note: state dict keys]) -----------------------------------------

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        self._state_dict_keep_vars = keep_vars
        flat = self.flat_param
        if flat is not None and flat.numel() != flat.full_numel:
            destination[prefix + FLAT_PARAM] = flat if keep_vars else flat.detach()

    def _flat_index(self) -> dict[tuple[int, str], int]:
        """``(id(module), name) -> index of its view`` for every flattened name."""
        flat = self.flat_param
        if flat is None:
            return {}
        index = {(id(i.module), i.param_name): k for k, i in enumerate(flat._param_infos)}
        for s in flat._shared_param_infos:
            index[(id(s.module), s.param_name)] = index[(id(s.prim_module), s.prim_param_name)]
        return index

    def _rewrite_state_dict(self, state_dict: dict[str, Any], prefix: str) -> None:
        inner = prefix + FPW_MODULE + "."
        ours = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(inner)]}
        flat = self.flat_param
        views: list[Tensor] = []
        if flat is not None and flat.numel() == flat.full_numel:
            views = list(flat.get_param_views())
            if not self._state_dict_keep_vars:
                views = [v.detach() for v in views]
        index = self._flat_index() if views else {}
        # Leaf names saved under each module path, in saved order.
        by_path: dict[str, list[str]] = {}
        for key in ours:
            path, _, leaf = key[len(inner) :].rpartition(".")
            by_path.setdefault(f"{path}." if path else "", []).append(leaf)
        out: list[tuple[str, Any]] = []
        done: set[str] = set()

        def visit(m: nn.Module, path: str) -> None:
            # The order nn.Module.state_dict uses: own parameters (in original
            # registration order), then everything else saved for this module,
            # then children, depth first, shared modules once per path.
            leaves = by_path.get(path, [])
            for n in self._param_order.get(m, list(m._parameters)):
                k = index.get((id(m), n))
                if k is not None:
                    out.append((path + n, views[k]))
                elif n in leaves:
                    out.append((path + n, ours[inner + path + n]))
                    done.add(inner + path + n)
            for leaf in leaves:
                if inner + path + leaf not in done:
                    out.append((path + leaf, ours[inner + path + leaf]))
                    done.add(inner + path + leaf)
            for child_name, child in m._modules.items():
                if child is not None:
                    visit(child, f"{path}{child_name}.")

        visit(self._fpw_module, "")
        # Keys the walk did not place (renamed by an inner module's own hook) keep their order.
        out.extend((k[len(inner) :], v) for k, v in ours.items() if k not in done)
        for key, value in out:
            state_dict[prefix + key] = value

        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:
            self._rewrite_metadata(metadata, prefix)

    @staticmethod
    def _rewrite_metadata(metadata: dict[str, Any], prefix: str) -> None:
        own = prefix[:-1]
        inner_root = prefix + FPW_MODULE
        if inner_root not in metadata:
            return
        renamed: OrderedDict[str, Any] = OrderedDict()
        for key, value in metadata.items():
            if key == own:
                continue  # replaced by the wrapped module's entry, which follows it
            if key == inner_root:
                renamed[own] = value
            elif key.startswith(inner_root + "."):
                renamed[prefix + key[len(inner_root) + 1 :]] = value
            else:
                renamed[key] = value
        metadata.clear()
        metadata.update(renamed)

    def _load_from_state_dict(  # noqa: PLR0917 (nn.Module's signature)
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        flat = self.flat_param
        if flat is not None:
            assign = bool(local_metadata.get("assign_to_params_buffers", False))
            self._load_flat(
                flat,
                state_dict=state_dict,
                prefix=prefix,
                assign=assign,
                missing_keys=missing_keys,
                error_msgs=error_msgs,
            )
        # Everything else belongs to the wrapped module: move it down one level.
        inner = prefix + FPW_MODULE + "."
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
            state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
        # nn.Module still runs registered pre-hooks and the unexpected-key check;
        # flat_param is hidden so it is not reported missing.
        saved = self._parameters[FLAT_PARAM]
        self._parameters[FLAT_PARAM] = None
        try:
            super()._load_from_state_dict(
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )
        finally:
            self._parameters[FLAT_PARAM] = saved

    def _load_flat(
        self,
        flat: FlatParameter,
        *,
        state_dict: dict[str, Any],
        prefix: str,
        assign: bool,
        missing_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        flat_key = prefix + FLAT_PARAM
        loaded_whole = False
        if flat_key in state_dict:  # the seed's format (see [Note: state dict keys])
            value = state_dict.pop(flat_key)
            if not isinstance(value, Tensor) or value.shape != flat.shape:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                error_msgs.append(
                    f"size mismatch for {flat_key}: copying a param with shape {shape} from "
                    f"checkpoint, the shape in current model is {tuple(flat.shape)}."
                )
            else:
                with torch.no_grad():
                    flat.copy_(value)
                loaded_whole = True
        # Every name each flattened parameter answers to: tied names, and a
        # module reachable under several paths once per path, as nn.Module saves it.
        index = self._flat_index()
        names: list[tuple[int, str]] = []
        for path, m in self._fpw_module.named_modules(remove_duplicate=False):
            for n in self._param_order.get(m, []):
                k = index.get((id(m), n))
                if k is not None:
                    names.append((k, prefix + _join(path, n)))
        if flat.numel() != flat.full_numel:
            present = [key for _, key in names if key in state_dict]
            if present:
                error_msgs.append(
                    f"cannot load {present[:4]} into a sharded FlatParameter ({flat.numel()} of "
                    f"{flat.full_numel} elements on this rank); load before sharding, or load "
                    f"the local shard under {flat_key!r}"
                )
                for key in present:
                    state_dict.pop(key)
            elif not loaded_whole:
                missing_keys.append(flat_key)
            return
        with torch.no_grad():
            views = list(flat.get_param_views())
        values: dict[int, Tensor] = {}
        for k, key in names:
            if key not in state_dict:
                if not loaded_whole:
                    missing_keys.append(key)
                continue
            value = state_dict.pop(key)
            if not isinstance(value, Tensor) or value.shape != views[k].shape:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {shape} from "
                    f"checkpoint, the shape in current model is {tuple(views[k].shape)}."
                )
                continue
            values.setdefault(k, value)
        if assign and len(values) == len(views):
            dtypes = {v.dtype for v in values.values()}
            if len(dtypes) > 1:
                error_msgs.append(
                    f"cannot assign checkpoint tensors of dtypes {sorted(map(str, dtypes))} to "
                    "one FlatParameter; cast the state dict to one dtype or load without assign"
                )
                return
            # assign=True (e.g. a meta-device model): adopt the checkpoint's
            # values as new flat storage instead of copying into the old one.
            # Like nn.Module's assign, the parameter object is replaced (set_data
            # cannot move a meta tensor to a real device); its metadata and
            # requires_grad carry over.
            data = torch.cat([values[k].detach().reshape(-1) for k in range(len(views))])
            new_flat = FlatParameter._from_flat_data(data, flat.requires_grad)
            new_flat.__dict__.update(flat.__dict__)
            self.flat_param = new_flat
            self._unflatten_params_as_views()
            return
        with torch.no_grad():
            for k, value in values.items():
                views[k].copy_(value)
        # The in-place copy retires the views the modules hold (see [Note: flat
        # parameter views]); hand out fresh ones.
        self._unflatten_params_as_views()
