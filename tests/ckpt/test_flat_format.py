"""The pieces of flat coordination, alone ([Note: flat coordination] in
``ckpt/_format/chunk_table.py``): blob templates byte for byte against ``torch.save``,
tables through their bytes, the plan's writers and checks, the index through its bytes.
No process group."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ckpt._format.chunk_index import dcp_metadata, encode_index, read_index
from ckpt._format.chunk_plan import ChunkPlanError, plan_chunks
from ckpt._format.chunk_table import BYTES, TENSOR, ChunkTable, Row, dtype_code
from ckpt._format.flat_keys import flatten
from ckpt._format.tensor_blob import raw_bytes, saved_bytes, template_for

F32 = dtype_code(torch.float32)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.randn(5, 7).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.arange(10, dtype=torch.int64)[2:7],  # a view: only its bytes are saved
        torch.tensor(3.5),  # 0-dim, like an optimizer's step
        torch.empty(0, 4),
        torch.randn(257, 129, dtype=torch.float64),
    ],
    ids=["f32", "bf16", "bool", "view", "0-dim", "empty", "f64"],
)
def test_templated_blob_is_torch_saves_bytes(tensor: torch.Tensor) -> None:
    chunk = tensor.contiguous()
    template = template_for(chunk)
    assert template is not None
    other = torch.zeros_like(chunk) if chunk.dtype != torch.bool else ~chunk
    for t in (chunk, other):  # the template of the first serves the second
        blob = template.head + raw_bytes(t).tobytes() + template.tail
        expected = saved_bytes(t.clone())
        assert blob == expected
        assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), t)
        assert blob[template.data_at : template.data_at + t.nbytes] == raw_bytes(t).tobytes()


def test_no_template_where_the_split_is_not_sure() -> None:
    assert template_for(torch.randn(3, 4).t()) is None  # not contiguous
    assert template_for(torch.nn.Parameter(torch.randn(2))) is None  # a subclass
    assert template_for(torch.randn(2, 2).to_sparse()) is None


def _table(rank: int, world: int, *, extra: list[Row] | None = None) -> ChunkTable:
    """Rank ``rank``'s rows of a dim-0 sharded [world, 2] tensor, a replicated [3] tensor
    and a pickled value."""
    paths = [("model", "w"), ("model", "b"), ("step",)]
    rows = [
        Row(0, TENSOR, F32, (rank, 0), (1, 2), (world, 2)),
        Row(1, TENSOR, F32, (0,), (3,), (3,)),
        Row(2, BYTES, -1, (), (), ()),
        *(extra or []),
    ]
    return ChunkTable.of(paths, rows)


def test_tables_round_trip_through_their_bytes() -> None:
    table = _table(1, 4)
    again = ChunkTable.decode(table.encode())
    assert again.paths == table.paths and again.decoded() == table.decoded()
    assert again.fingerprint() == table.fingerprint()
    assert _table(2, 4).fingerprint() != table.fingerprint()
    assert table.keys() == ["model.w", "model.b", "step"]


def test_tables_of_other_paths_encode_their_own_paths() -> None:
    # The JSON of the last paths is kept for the next save: never another table's.
    one = _table(1, 4)
    other = ChunkTable.of([("x",), ("y", 0)], [Row(0, BYTES, -1, (), (), ())] * 2)
    for table in (one, other, one, ChunkTable.of(list(one.paths), one.decoded())):
        again = ChunkTable.decode(table.encode())
        assert again.paths == table.paths and again.decoded() == table.decoded()


_leaves = st.one_of(
    st.integers(-3, 3),
    st.text(max_size=3),
    st.none(),
    st.builds(torch.zeros, st.integers(0, 3)),
    st.tuples(st.integers(0, 3), st.builds(torch.ones, st.integers(1, 2))),
)
_keys = st.one_of(st.text("ab.0", max_size=3), st.integers(0, 3))
_nested = st.recursive(
    _leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_keys, inner, max_size=4)),
    max_leaves=20,
)


def _outcome(flat: Any) -> Any:
    try:
        values, paths = flat()
    except ValueError as e:
        return str(e)
    return list(paths.items()), [id(v) for v in values.values()], list(values)


@given(st.dictionaries(st.text("ab.", min_size=1, max_size=3), _nested, max_size=4))
def test_flattened_keys_are_dcps(state: dict[str, Any]) -> None:
    # Mappings walked by ckpt, lists by DCP: the same keys, paths, order and values as
    # DCP's flatten_state_dict, and the same error for keys that collide ("a.b").
    assert _outcome(lambda: flatten(state)) == _outcome(lambda: flatten_state_dict(state))


def test_plan_spreads_replicas_and_keeps_shards_with_their_rank() -> None:
    world = 4
    plan = plan_chunks([_table(r, world) for r in range(world)])
    assert list(plan.keys) == ["model.w", "model.b", "step"]
    shards = plan.keys["model.w"].chunks
    assert [(c.offsets, c.rank, c.row) for c in shards] == [((r, 0), r, 0) for r in range(world)]
    # The replicated tensor and the value are written once each, by different ranks
    # (the fewest bytes so far; ties to the lowest rank).
    [b] = plan.keys["model.b"].chunks
    [step] = plan.keys["step"].chunks
    assert b.rank != step.rank
    assert sorted(len(w) for w in plan.writes) == [1, 1, 2, 2]
    assert plan.nbytes > world * 2 * 4


@pytest.mark.parametrize(
    ("odd", "said"),
    [
        (Row(0, TENSOR, dtype_code(torch.bfloat16), (1, 0), (1, 2), (2, 2)), "differ in dtype"),
        (Row(0, TENSOR, F32, (1, 0), (1, 2), (3, 2)), "global shape differs"),
        (Row(0, BYTES, -1, (), (), ()), "a tensor on some ranks and a value on others"),
        (Row(0, TENSOR, F32, (0, 0), (2, 2), (2, 2)), r"parts at \[0, 0\] of different sizes"),
    ],
)
def test_plan_names_what_does_not_fit(odd: Row, said: str) -> None:
    good = _table(0, 2)
    paths = [("model", "w"), ("model", "b"), ("step",)]
    rows = [odd, Row(1, TENSOR, F32, (0,), (3,), (3,)), Row(2, BYTES, -1, (), (), ())]
    with pytest.raises(ChunkPlanError, match=said) as info:
        plan_chunks([good, ChunkTable.of(paths, rows)])
    assert "model.w" in str(info.value) and "ranks [1]" in str(info.value)


def test_plan_names_a_tensor_its_parts_do_not_cover() -> None:
    tables = [_table(0, 3), _table(1, 3)]  # rank 2's row of model.w is held by no one
    with pytest.raises(ChunkPlanError, match=r"model\.w: the ranks' parts cover 4 of its 6"):
        plan_chunks(tables)


def test_index_and_metadata_say_where_every_chunk_lies(tmp_path: Path) -> None:
    world = 2
    plan = plan_chunks([_table(r, world) for r in range(world)])
    stored = [[(100 * (i + 1), 50, 100 * (i + 1) + 10) for i in range(len(w))] for w in plan.writes]
    (tmp_path / "ckpt-index.bin").write_bytes(encode_index(plan, stored))
    index = read_index(tmp_path)
    assert index.native and list(index.keys) == list(plan.keys)
    w = index.keys["model.w"]
    assert (w.dtype, w.shape) == (torch.float32, (2, 2))
    assert [(c.offsets, c.sizes, c.file) for c in w.chunks] == [
        ((0, 0), (1, 2), "__0_0.distcp"),
        ((1, 0), (1, 2), "__1_0.distcp"),
    ]
    assert index.keys["step"].kind == BYTES and index.keys["step"].dtype is None
    metadata = pickle.loads(pickle.dumps(dcp_metadata(plan, stored)))
    assert metadata.planner_data == {"model.w": ("model", "w"), "model.b": ("model", "b"),
                                     "step": ("step",)}  # fmt: skip
    infos = {(i.fqn, None if i.offset is None else tuple(i.offset)): (s.relative_path, s.offset)
             for i, s in metadata.storage_data.items()}  # fmt: skip
    for name, key in index.keys.items():
        for c in key.chunks:
            where = (name, c.offsets if key.kind != BYTES else None)
            assert infos[where] == (c.file, c.offset)
