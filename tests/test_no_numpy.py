"""asyncckpt's own collectives need no NumPy (torch 2.13's object collectives do).

A real 2-rank job started with ``torch.distributed.run``, in which ``import numpy``
fails as in an environment without NumPy: torch then reports NumPy as unavailable and
its ``all_gather_object`` raises ``RuntimeError: Numpy is not available``. An
asynchronous save, its background commit and ``verify`` must still work.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from dist_utils import free_port
from helpers import finish_session

_RANK_SCRIPT = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    assert "numpy" not in sys.modules  # torch imported without it
    import asyncckpt
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        dist.all_gather_object([None, None], rank)
    except RuntimeError as exc:
        assert "Numpy is not available" in str(exc), exc
        print("torch object collectives: no numpy", flush=True)
    else:
        raise AssertionError("numpy is importable: the test does not test anything")
    state = {"w": torch.full((1000,), float(rank)), "step": 3}
    mgr = asyncckpt.CheckpointManager(sys.argv[1], keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, state).wait()
    mgr.close()
    if rank == 0:
        asyncckpt.verify(mgr.step_dir(3))
        print("saved", mgr.steps(), flush=True)
    dist.destroy_process_group()
""")


def test_two_ranks_save_without_numpy(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker" / "numpy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'numpy\' (blocked by the test)", name="numpy")\n'
    )
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(blocker.parent), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        str(tmp_path / "ckpt"),
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    rc, out, _ = finish_session(proc, 100)
    assert rc == 0, out
    assert out.count("torch object collectives: no numpy") == 2, out
    assert "saved [2, 3]" in out, out
