"""flatparam's exit hook ([Note: clean exit] in ``flatparam/_clean_exit.py``): a DDP
module left in a garbage cycle after the script destroyed the default group must not
have its gloo group destroyed inside the hook's collection, with the GIL held (that
deadlocked 2 runs in 19 of examples/minimal/ddp_zero.py). The hook holds the groups
that DDP modules name until the collection is over.

The race itself (a gloo worker thread dropping its last work at that moment) cannot be
forced; what is tested is that the hook finds the group the collection would free, and
that such a process exits cleanly.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.process_tree import kill_tree

SCRIPT = textwrap.dedent(
    """
    import gc, os, socket
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import zero_optim  # registers the exit hook
    from flatparam import _clean_exit

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    net = torch.nn.Linear(4, 4)
    model = DDP(net)
    model(torch.randn(2, 4)).sum().backward()
    group = model.process_group
    model.me = model  # a cycle: only a collection frees it (and its C++ Reducer)
    dist.destroy_process_group()  # as torchrun scripts end
    del model, net
    found = _clean_exit._groups_of_ddp_modules()
    assert any(g is group for g in found), found
    del found, group
    print("found the group", flush=True)
    """
)


@pytest.mark.timeout(120)
def test_exit_hook_holds_the_group_of_a_ddp_module_in_a_cycle() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"the process did not exit in 90 s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    assert "found the group" in out, out
