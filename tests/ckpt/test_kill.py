"""A save killed (SIGKILL) midway in a subprocess: the previous checkpoint survives.

The child commits step 1, then dies during the save of step 2, at a point chosen
without any timing: while DCP writes the data files (pickling an object that kills
its own process), or after the manifest is written, just before the commit rename.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckpt
from tests.ckpt._common import assert_same, linear, make_model, params

_CHILD = textwrap.dedent(
    """
    import os, pathlib, signal, sys
    import torch
    import ckpt
    from tests.ckpt._common import make_model

    root, where = sys.argv[1], sys.argv[2]
    model = make_model(0)
    manager = ckpt.CheckpointManager(root, keep_last=1)
    manager.save(1, {"model": model})
    with torch.no_grad():
        model[0].weight.add_(1.0)

    class DieWhenWritten:
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGKILL)

    state = {"model": model}
    if where == "write":
        state["bomb"] = DieWhenWritten()
    else:
        rename = pathlib.Path.rename

        def die_at_commit(self, target):
            if pathlib.Path(target).name == "step_00000002":
                os.kill(os.getpid(), signal.SIGKILL)
            return rename(self, target)

        pathlib.Path.rename = die_at_commit
    manager.save(2, state)
    print("the save was not killed")
    """
)


@pytest.mark.slow
def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    children = {
        where: subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path / where), where],
            cwd=repo,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for where in ("write", "commit")
    }
    for where, child in children.items():
        out, _ = child.communicate(timeout=120)
        assert child.returncode == -9, f"{where}: {child.returncode}\n{out.decode()}"

    expected = params(make_model(0))
    for where in ("write", "commit"):
        manager = ckpt.CheckpointManager(tmp_path / where, keep_last=1)
        assert manager.steps() == [1]
        [partial] = manager.partial()
        assert re.fullmatch(r"\.step_00000002\.[0-9a-f]{16}\.partial", partial.name)
        # The killed save's lease is left too; the next save recovers it.
        assert (tmp_path / where / ".step_00000002.lease").is_file()
        # Killed after the manifest: the files are complete, yet never committed.
        assert (partial / ckpt.MANIFEST_NAME).exists() == (where == "commit")
        with pytest.raises(ckpt.PartialCheckpointError) as info:
            ckpt.load({"model": make_model(3)}, manager.path(2))
        assert info.value.partial == partial

        fresh = make_model(3)
        with pytest.warns(UserWarning) as warned:
            assert manager.load_latest({"model": fresh}) == 1
        said = "\n".join(str(w.message) for w in warned)
        # The killed job's hold on the folder is taken over; its leftover is named.
        assert partial.name in said and "took over" in said and "job that is gone" in said, said
        assert_same(params(fresh), expected)
        ckpt.verify(manager.path(1))

        # The next save cleans up and prunes step 1 only once step 2 is committed.
        with torch.no_grad():
            linear(fresh, 0).weight.add_(1.0)
        with pytest.warns(UserWarning) as warned:
            manager.save(2, {"model": fresh})
        said = "\n".join(str(w.message) for w in warned)
        assert partial.name in said and "recovered the lease" in said, said
        assert manager.steps() == [2] and manager.partial() == []
        manager.close()  # this job's hold on the folder goes too
        assert sorted(p.name for p in (tmp_path / where).iterdir()) == ["step_00000002"]
