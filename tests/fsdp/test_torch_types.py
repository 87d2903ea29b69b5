"""torch's option types, wrap policies and argument forms accepted as torch's FSDP1 accepts them.

A script (or a library such as Lightning) written against torch's FSDP1 builds torch's
own option objects and passes them to whichever class it was given; ours must take
them and behave exactly as with our own types, and raise torch's exception types (or
subclasses) and warnings for the same mistakes.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp
import torch.distributed.fsdp.wrap as twrap
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp
from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817 (torch's usual name)
from fsdp import wrap
from tests.fsdp._common import Block, batches, make_net, train
from tests.ranks import run_ranks

# --- conversion, no process group -----------------------------------------------------------


def test_enums_convert_by_name() -> None:
    for name in ("ShardingStrategy", "BackwardPrefetch", "StateDictType"):
        for member in getattr(tfsdp, name):
            ours = fsdp.to_fsdp_type(member, getattr(fsdp, name), "x")
            assert type(ours) is getattr(fsdp, name) and ours.name == member.name
    key = tfsdp.fully_sharded_data_parallel.OptimStateKeyType.PARAM_ID
    assert fsdp.to_fsdp_type(key, fsdp.OptimStateKeyType, "x") is fsdp.OptimStateKeyType.PARAM_ID


def test_configs_convert_field_by_field() -> None:
    mp = tfsdp.MixedPrecision(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float16,
        buffer_dtype=torch.bfloat16,
        keep_low_precision_grads=True,
        cast_forward_inputs=True,
        cast_root_forward_inputs=False,
        _module_classes_to_ignore=(nn.LayerNorm,),
    )
    assert fsdp.to_fsdp_type(mp, fsdp.MixedPrecision, "mixed_precision") == fsdp.MixedPrecision(
        torch.bfloat16, torch.float16, torch.bfloat16, True, True, False, (nn.LayerNorm,)
    )
    assert fsdp.to_fsdp_type(
        tfsdp.CPUOffload(offload_params=True), fsdp.CPUOffload, "c"
    ) == fsdp.CPUOffload(True)
    # A subclass of the expected type comes back as our subclass.
    full = fsdp.to_fsdp_type(
        tfsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True), fsdp.StateDictConfig, "s"
    )
    assert full == fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim = fsdp.to_fsdp_type(
        tfsdp.ShardedOptimStateDictConfig(offload_to_cpu=False), fsdp.OptimStateDictConfig, "o"
    )
    assert type(optim) is fsdp.ShardedOptimStateDictConfig and not optim.offload_to_cpu
    settings = tfsdp.StateDictSettings(
        tfsdp.StateDictType.LOCAL_STATE_DICT,
        tfsdp.LocalStateDictConfig(offload_to_cpu=True),
        tfsdp.LocalOptimStateDictConfig(),
    )
    assert fsdp.to_fsdp_type(settings, fsdp.StateDictSettings, "s") == fsdp.StateDictSettings(
        fsdp.StateDictType.LOCAL_STATE_DICT,
        fsdp.LocalStateDictConfig(offload_to_cpu=True),
        fsdp.LocalOptimStateDictConfig(),
    )


def test_wrong_types_name_both_accepted_types() -> None:
    with pytest.raises(
        TypeError,
        match=r"sharding_strategy must be fsdp\.ShardingStrategy or "
        r"torch\.distributed\.fsdp\.ShardingStrategy, got 1 \(builtins\.int\)",
    ):
        fsdp.to_fsdp_type(1, fsdp.ShardingStrategy, "sharding_strategy")
    # torch's type, but the wrong one: still both names, and the torch type's full name.
    with pytest.raises(TypeError, match=r"got .*torch\.distributed\.fsdp\.api\.CPUOffload"):
        fsdp.to_fsdp_type(tfsdp.CPUOffload(), fsdp.MixedPrecision, "mixed_precision")
    with pytest.raises(TypeError, match=r"got .*LocalStateDictConfig"):
        fsdp.to_fsdp_type(tfsdp.LocalStateDictConfig(), fsdp.OptimStateDictConfig, "o")


def test_policies_convert() -> None:
    mwp = fsdp.to_fsdp_policy(twrap.ModuleWrapPolicy({Block}))
    assert isinstance(mwp, wrap.ModuleWrapPolicy) and mwp._module_classes == {Block}
    custom = fsdp.to_fsdp_policy(twrap.CustomPolicy(lambda m: isinstance(m, Block)))
    assert isinstance(custom, wrap.CustomPolicy)
    fn = fsdp.to_fsdp_policy(
        functools.partial(twrap.transformer_auto_wrap_policy, transformer_layer_cls={Block})
    )
    assert fn.func is wrap.transformer_auto_wrap_policy and fn.keywords["transformer_layer_cls"]
    size = fsdp.to_fsdp_policy(functools.partial(twrap.size_based_auto_wrap_policy, 10))
    assert size.func is wrap.size_based_auto_wrap_policy and size.args == (10,)
    assert fsdp.to_fsdp_policy(twrap.always_wrap_policy) is wrap.always_wrap_policy
    either = fsdp.to_fsdp_policy(
        functools.partial(twrap._or_policy, policies=[twrap.always_wrap_policy])
    )
    assert either.func is wrap._or_policy and either.keywords["policies"] == [
        wrap.always_wrap_policy
    ]


# --- the same exception types as torch's FSDP ------------------------------------------------


def _error_type(fn: Any) -> type[BaseException] | None:
    try:
        fn()
    except Exception as e:  # the case under test
        return type(e)
    return None


def _module(kwargs: dict[str, Any]) -> nn.Module:
    # torch checks param_init_fn only when there is something to materialise.
    return nn.Linear(2, 2, device="meta" if "param_init_fn" in kwargs else "cpu")


def _build(cls: Any, kwargs: dict[str, Any]) -> None:
    cls(_module(kwargs), **kwargs)


def _constructor_errors_rank() -> list[tuple[str, str, str]]:
    """(case, torch's exception type, ours) for each mistake, ours a subclass of torch's."""
    cases: dict[str, dict[str, Any]] = {
        "param_init_fn=42": {"param_init_fn": 42, "device_id": "cpu"},
        "device_id=1.5": {"device_id": 1.5},
        "device_id='bogus'": {"device_id": "bogus"},
    }
    if not torch.cuda.is_available():
        cases["device_id=0 without CUDA"] = {"device_id": 0}
    out = []
    for name, kwargs in cases.items():
        theirs = _error_type(functools.partial(_build, tfsdp.FullyShardedDataParallel, kwargs))
        ours = _error_type(functools.partial(_build, FSDP, kwargs))
        assert theirs is not None and ours is not None, (name, theirs, ours)
        assert issubclass(ours, theirs), (name, theirs, ours)
        out.append((name, theirs.__name__, ours.__name__))
    # Mistakes after construction, against models of each class.
    for name, call in {
        "summon rank0_only with writeback": lambda cls, m: cls.summon_full_params(
            m, rank0_only=True, writeback=True
        ).__enter__(),
        "summon with_grads without use_orig_params": lambda cls, m: cls.summon_full_params(
            m, with_grads=True
        ).__enter__(),
        "state-dict config of another type": lambda cls, m: cls.set_state_dict_type(
            m, tfsdp.StateDictType.LOCAL_STATE_DICT, tfsdp.FullStateDictConfig()
        ),
        "comm hook not callable": lambda cls, m: m.register_comm_hook(None, 3),
        "ignored_modules not modules": lambda cls, m: cls(
            nn.Linear(2, 2), ignored_modules=[3], device_id="cpu"
        ),
    }.items():
        types = []
        for cls in (tfsdp.FullyShardedDataParallel, FSDP):
            model = cls(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), device_id="cpu")
            types.append(_error_type(functools.partial(call, cls, model)))
        theirs, ours = types
        assert theirs is not None and ours is not None, (name, theirs, ours)
        assert issubclass(ours, theirs), (name, theirs, ours)
        out.append((name, theirs.__name__, ours.__name__))
    # apply() inside summon_full_params: torch raises ValueError.
    for cls in (tfsdp.FullyShardedDataParallel, FSDP):
        model = cls(nn.Linear(2, 2), device_id="cpu")
        with cls.summon_full_params(model), pytest.raises(ValueError, match=r"IDLE|expected"):
            model.apply(lambda m: None)
    return out


def test_constructor_errors_match_torch() -> None:
    (out,) = run_ranks(_constructor_errors_rank, 1)
    assert [name for name, _, _ in out][:3] == [
        "param_init_fn=42",
        "device_id=1.5",
        "device_id='bogus'",
    ]


def _device_id_forms_rank() -> list[str]:
    devices = []
    for device_id in ("cpu", torch.device("cpu"), None):
        model = FSDP(make_net(), device_id=device_id)
        devices.append(str(model.compute_device))
        train(model, batches(1))
    return devices


@pytest.mark.parametrize("world_size", [1, 2])
def test_device_id_forms(world_size: int) -> None:
    assert run_ranks(_device_id_forms_rank, world_size) == [["cpu"] * 3] * world_size


def _clip_without_grads_rank() -> list[str]:
    """Each rank's warnings from a clip with no gradient, torch's FSDP then ours."""
    seen = []
    for cls in (tfsdp.FullyShardedDataParallel, FSDP):
        model = cls(make_net(), device_id="cpu")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.clip_grad_norm_(1.0)
        seen.append(";".join(f"{type(w.message).__name__}: {w.message}" for w in caught))
    return seen


@pytest.mark.parametrize("world_size", [1, 2])
def test_clip_grad_norm_without_gradients_warns_as_torch(world_size: int) -> None:
    out = run_ranks(_clip_without_grads_rank, world_size)
    for rank, (theirs, ours) in enumerate(out):
        if world_size == 1:  # NO_SHARD: both use torch.nn.utils.clip_grad_norm_, no warning
            assert theirs == ours == "", out
            continue
        pattern = (
            rf"UserWarning: .*clip_grad_norm_\(\) .*on rank {rank} with no gradients -- "
            r"returning the total norm in the default dtype torch\.float32"
        )
        assert re.fullmatch(pattern, theirs) and re.fullmatch(pattern, ours), out


def test_explicit_group_before_init_process_group() -> None:
    """torch's FSDP takes a group built by hand without init_process_group; so does ours."""
    assert not dist.is_initialized()
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    torch.manual_seed(0)
    model = FSDP(nn.Linear(3, 3), process_group=group, device_id="cpu")
    model(torch.randn(2, 3)).sum().backward()
    assert (model.rank, model.world_size) == (0, 1)
    assert model._flat_param.grad is not None
    assert not dist.is_initialized()


class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block(4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.block(x)))


def _units_rank() -> list[list[str]]:
    out = []
    for mp in (None, fsdp.MixedPrecision(param_dtype=torch.bfloat16)):
        counts = []
        for cls, policy, mixed in (
            (tfsdp.FullyShardedDataParallel, twrap.ModuleWrapPolicy({Block}), mp and _torch_mp(mp)),
            (FSDP, wrap.ModuleWrapPolicy({Block}), mp),
        ):
            torch.manual_seed(0)
            model = cls(_BNNet(), auto_wrap_policy=policy, mixed_precision=mixed, device_id="cpu")
            counts.append(
                sorted(
                    type(m.module).__name__  # type: ignore[union-attr]
                    for m in cls.fsdp_modules(model)
                )
            )
        assert counts[0] == counts[1], counts
        out.append(counts[1])
    return out


def _torch_mp(mp: fsdp.MixedPrecision) -> tfsdp.MixedPrecision:
    return tfsdp.MixedPrecision(param_dtype=mp.param_dtype)


def test_batch_norm_gets_its_own_unit_only_with_mixed_precision() -> None:
    """As torch's: the batch-norm override applies only when mixed_precision was passed."""
    (out,) = run_ranks(_units_rank, 1)
    assert out == [["Block", "_BNNet"], ["BatchNorm1d", "Block", "_BNNet"]]


# --- training with torch's types equals training with ours ----------------------------------


def _train_with(types: str, use_orig_params: bool) -> tuple[list[float], list[str], bool]:
    t = tfsdp if types == "torch" else fsdp
    w = twrap if types == "torch" else wrap
    policies: list[Any] = [
        w.ModuleWrapPolicy({Block}),
        w.CustomPolicy(lambda m: {"backward_prefetch": None} if isinstance(m, Block) else False),
        functools.partial(w.transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        functools.partial(w.size_based_auto_wrap_policy, min_num_params=100),
    ]
    losses: list[float] = []
    for policy, strategy in zip(
        policies,
        [
            t.ShardingStrategy.FULL_SHARD,
            t.ShardingStrategy.SHARD_GRAD_OP,
            t.ShardingStrategy.NO_SHARD,
            t.ShardingStrategy.FULL_SHARD,
        ],
        strict=True,
    ):
        model = FSDP(
            make_net(),
            sharding_strategy=strategy,
            auto_wrap_policy=policy,
            backward_prefetch=t.BackwardPrefetch.BACKWARD_POST,
            mixed_precision=t.MixedPrecision(reduce_dtype=torch.float32),
            cpu_offload=t.CPUOffload(offload_params=False),
            device_id="cpu",
            use_orig_params=use_orig_params,
        )
        losses += train(model, batches(2))[0]
    FSDP.set_state_dict_type(
        model,
        t.StateDictType.SHARDED_STATE_DICT,
        t.ShardedStateDictConfig(offload_to_cpu=True),
        t.ShardedOptimStateDictConfig(offload_to_cpu=True),
    )
    settings = FSDP.get_state_dict_type(model)
    sd = model.state_dict()
    with FSDP.state_dict_type(model, t.StateDictType.FULL_STATE_DICT, t.FullStateDictConfig()):
        full_type = FSDP.get_state_dict_type(model).state_dict_type.name
    return (
        losses,
        [settings.state_dict_type.name, type(settings.state_dict_config).__name__, full_type],
        all(isinstance(v, DTensor) for k, v in sd.items() if k != "scale"),  # params only
    )


def _compare_rank(use_orig_params: bool) -> None:
    ours = _train_with("ours", use_orig_params)
    theirs = _train_with("torch", use_orig_params)
    assert theirs == ours, (theirs, ours)
    assert ours[1] == ["SHARDED_STATE_DICT", "ShardedStateDictConfig", "FULL_STATE_DICT"]
    assert ours[2]


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_torch_types_train_exactly_as_ours(use_orig_params: bool) -> None:
    run_ranks(_compare_rank, 2, use_orig_params, timeout=120)


def _world_size_one_warning_rank() -> list[str]:
    out = []
    for cls in (tfsdp.FullyShardedDataParallel, FSDP):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls(nn.Linear(2, 2), device_id="cpu")
        out.append(";".join(str(w.message) for w in caught if "NO_SHARD" in str(w.message)))
    return out


def test_world_size_one_warns_as_torch() -> None:
    (out,) = run_ranks(_world_size_one_warning_rank, 1)
    assert (
        out[0]
        == out[1]
        == (
            "FSDP is switching to use `NO_SHARD` instead of ShardingStrategy.FULL_SHARD since the "
            "world size is 1."
        )
    ), out


# --- torch's words in our messages -------------------------------------------------------------
# Code and tests written against torch's FSDP1 match its messages (torch's own tests use
# assertRaisesRegex on them); ours keep their clearer text and contain torch's words too.
# Each case runs against torch's FSDP1 and ours; ``phrase`` is what both must contain
# (torch's message itself where it has no object reprs that differ between the two).


def _two_level(cls: Any, **kwargs: Any) -> nn.Module:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    net[0] = cls(net[0], device_id="cpu", **kwargs)
    return cls(net, device_id="cpu", **kwargs)


def _forward(model: nn.Module) -> None:
    model(torch.ones(1, 2)).sum().backward()


def _apply_in_summon(cls: Any) -> None:
    model = _two_level(cls)
    with cls.summon_full_params(model):
        model.apply(lambda m: None)


def _nested_after_forward(cls: Any) -> nn.Module:
    """The inner instance of a model that ran (so the outer one is the root)."""
    model = _two_level(cls)
    _forward(model)
    return model.module[0]  # type: ignore[no-any-return]


def _summon_in_forward(cls: Any) -> None:
    model = _two_level(cls)

    def hook(*args: Any) -> None:
        with cls.summon_full_params(model):
            pass

    model.module[1].register_forward_hook(hook)
    _forward(model)


def _summon_in_summon(cls: Any) -> None:
    model = _two_level(cls)
    with cls.summon_full_params(model), cls.summon_full_params(model):
        pass


def _comm_hook_twice(cls: Any) -> None:
    from torch.distributed.algorithms._comm_hooks import default_hooks

    model = _two_level(cls)
    state = default_hooks.DefaultState(dist.group.WORLD)
    model.register_comm_hook(state, default_hooks.reduce_scatter_hook)
    model.register_comm_hook(state, default_hooks.reduce_scatter_hook)


def _comm_hook_nested(cls: Any) -> None:
    from torch.distributed.algorithms._comm_hooks import default_hooks

    model = _two_level(cls)
    _forward(model)
    state = default_hooks.DefaultState(dist.group.WORLD)
    model.module[0].register_comm_hook(state, default_hooks.reduce_scatter_hook)


def _mixed_use_orig_params(cls: Any) -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    net[0] = cls(net[0], device_id="cpu", use_orig_params=True)
    _forward(cls(net, device_id="cpu", use_orig_params=False))


def _settings_differ(cls: Any) -> None:
    model = _two_level(cls)
    cls.set_state_dict_type(model.module[0], tfsdp.StateDictType.SHARDED_STATE_DICT)
    cls.get_state_dict_type(model)


def _rekey_mixed_keys(cls: Any) -> None:
    model = _two_level(cls)
    osd = {"state": {0: {}, "1.weight": {}}, "param_groups": []}
    cls.rekey_optim_state_dict(osd, tfsdp.OptimStateKeyType.PARAM_NAME, model)


def _ignored_mixed(cls: Any) -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    cls(net, device_id="cpu", ignored_states=[net[0], net[1].weight])


MESSAGE_CASES: dict[str, tuple[Any, str]] = {
    "apply() inside summon_full_params()": (
        _apply_in_summon,
        r"expected to be in states \[.*IDLE.*\] but current state is .*SUMMON_FULL_PARAMS",
    ),
    "no_sync() on a nested instance": (
        lambda cls: _nested_after_forward(cls).no_sync().__enter__(),
        re.escape(
            "`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` on "
            "root FSDP module."
        ),
    ),
    "clip_grad_norm_() on a nested instance": (
        lambda cls: _nested_after_forward(cls).clip_grad_norm_(1.0),
        re.escape("`clip_grad_norm_()` should only be called on the root FSDP instance"),
    ),
    "summon_full_params() inside forward": (
        _summon_in_forward,
        "Cannot manually unshard parameters during forward/backward",
    ),
    "summon_full_params() inside summon_full_params()": (
        _summon_in_summon,
        "Cannot manually unshard parameters when already unsharding parameters",
    ),
    "summon rank0_only with writeback": (
        lambda cls: cls.summon_full_params(
            _two_level(cls), rank0_only=True, writeback=True
        ).__enter__(),
        "writeback=True and rank0_only=True is not supported yet",
    ),
    "summon with_grads without use_orig_params": (
        lambda cls: cls.summon_full_params(_two_level(cls), with_grads=True).__enter__(),
        "with_grads=True, use_orig_params=False, offload_to_cpu=False is not supported yet",
    ),
    "register_comm_hook twice": (_comm_hook_twice, "A communication hook is already registered"),
    "register_comm_hook on a nested instance": (
        _comm_hook_nested,
        r"^register_comm_hook can only be called on a root instance\.$",  # torch's test: ^...$
    ),
    "register_comm_hook(hook=3)": (
        lambda cls: _two_level(cls).register_comm_hook(None, 3),
        "The communication hook must be callable but got 3",
    ),
    "param_init_fn=42": (
        lambda cls: cls(nn.Linear(2, 2, device="meta"), param_init_fn=42, device_id="cpu"),
        "Expected 42 to be callable but got <class 'int'>",
    ),
    "use_orig_params mixed": (
        _mixed_use_orig_params,
        "Expects one homogeneous value for _use_orig_params but got",
    ),
    "ignored_modules and ignored_states": (
        lambda cls: cls(nn.Linear(2, 2), device_id="cpu", ignored_modules=[], ignored_states=[]),
        "Cannot pass both ignored_modules and ignored_states at the same time",
    ),
    "ignored_states mixing parameters and modules": (
        _ignored_mixed,
        "ignored_states expects all nn.Parameter or all nn.Module list elements but got types",
    ),
    "ignored_modules=[3]": (
        lambda cls: cls(nn.Linear(2, 2), device_id="cpu", ignored_modules=[3]),
        re.escape("ignored_modules expects nn.Module list elements but got types [<class 'int'>]"),
    ),
    "ignored_modules holding an FSDP instance": (
        lambda cls: cls(
            _two_level(cls).module, device_id="cpu", ignored_modules=[_two_level(cls).module[0]]
        ),
        "`ignored_modules` should not include FSDP modules",
    ),
    "state-dict config of another type": (
        lambda cls: cls.set_state_dict_type(
            _two_level(cls), tfsdp.StateDictType.LOCAL_STATE_DICT, tfsdp.FullStateDictConfig()
        ),
        "Expected state_dict_config of type <class '.*LocalStateDictConfig'> but got "
        "<class '.*FullStateDictConfig'>",
    ),
    "state-dict settings differ between instances": (
        _settings_differ,
        "All FSDP modules must have the same state dict settings",
    ),
    "rekey_optim_state_dict with mixed keys": (
        _rekey_mixed_keys,
        re.escape("Invalid parameter keys: dict_keys([0, '1.weight'])"),
    ),
}


def _messages_rank() -> dict[str, list[tuple[str, str]]]:
    """case -> [(torch's exception type, message), (ours)]."""
    out: dict[str, list[tuple[str, str]]] = {}
    for name, (call, _) in MESSAGE_CASES.items():
        out[name] = []
        for cls in (tfsdp.FullyShardedDataParallel, FSDP):
            try:
                call(cls)
                out[name].append(("no error", ""))
            except Exception as e:  # the case under test
                assert isinstance(e, Exception)
                out[name].append((f"{type(e).__module__}.{type(e).__qualname__}", str(e)))
                mro = [f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__]
                out[name][-1] = (";".join(mro), str(e))
        dist.barrier()
    # torch's warning for ignoring the root module, and for clipping without gradients.
    for cls in (tfsdp.FullyShardedDataParallel, FSDP):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            net = nn.Linear(2, 2)
            cls(net, device_id="cpu", ignored_modules=[net])
        text = ";".join(str(w.message) for w in caught if w.category is UserWarning)
        out.setdefault("ignoring the root warns", []).append(("UserWarning", text))
    return out


def test_messages_carry_torchs_words() -> None:
    for out in run_ranks(_messages_rank, 2, timeout=120):
        for name, (theirs, ours) in out.items():
            phrase = (
                "Trying to ignore the top-level module passed into the FSDP constructor itself "
                "will result in all parameters being ignored and is not well-supported"
                if name == "ignoring the root warns"
                else MESSAGE_CASES[name][1]
            )
            assert re.search(phrase, theirs[1]), (name, "torch's own message changed", theirs)
            assert re.search(phrase, ours[1]), (name, ours, "lacks", phrase)
            # Ours is torch's exception type or a subclass of it.
            their_type = theirs[0].split(";")[0]
            assert their_type in ours[0].split(";"), (name, theirs[0], ours[0])
