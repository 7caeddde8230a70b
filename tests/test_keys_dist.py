"""Keys on 2 real gloo ranks (spawned processes on 127.0.0.1): an optimizer's ``int``
keys saved by both ranks (issue 24 item 1), and an entry that differs across ranks
(issue 25 item 9): a tensor on one rank and a value on the other, a plain tensor of
another shape or dtype, a key ``int`` on one rank and ``str`` on the other. Each is a
``CheckpointError`` naming the entry on every rank, with nothing written, and the next
save of a consistent state commits.

The rank functions catch and return what they observed; the assertions run here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_utils import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _good_state(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)  # replicated, as with DDP
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), f"rank{rank}": {rank: torch.full((2,), rank)}}


def _bad_states(rank: int) -> dict[str, dict[str, Any]]:
    return {
        "tensor or value": {"x": torch.ones(3) if rank == 0 else 7, "ok": torch.zeros(1)},
        "shape": {"x": torch.ones(3 + rank), "ok": torch.zeros(1)},
        "rank of shape": {"x": torch.ones(4) if rank == 0 else torch.ones(2, 2)},
        "dtype": {"x": torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64)},
        "key type": {"x": {0 if rank == 0 else "0": torch.ones(3)}},
    }


def _rank_keys(rank: int, world_size: int, root: str, persistent: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import asyncckpt
    from asyncckpt import AsyncCallsQueue, CheckpointError

    out: dict[str, Any] = {"errors": {}}
    root_p = Path(root)
    queue = AsyncCallsQueue(persistent=persistent)
    try:
        for name, state in _bad_states(rank).items():
            for async_op in (False, True):
                target = root_p / f"{name.replace(' ', '_')}_{async_op}"
                try:
                    asyncckpt.save(state, target, async_op=async_op, calls_queue=queue)
                    out["errors"][(name, async_op)] = None
                except CheckpointError as exc:
                    out["errors"][(name, async_op)] = str(exc)
                except BaseException as exc:  # noqa: BLE001 - the wrong kind, reported
                    out["errors"][(name, async_op)] = f"WRONG {type(exc).__name__}: {exc}"
                dist.barrier()
                out.setdefault("written", []).append(target.exists())
        # A consistent state with int keys commits afterwards, twice (the second from
        # the cached plan), and reads back with them.
        state = _good_state(rank)
        try:
            for step in (1, 2):
                asyncckpt.save(state, root_p / f"good{step}", async_op=True, calls_queue=queue).wait(timeout=60)
        except CheckpointError as exc:
            out["good"] = str(exc)
            return out
        dist.barrier()
        got = asyncckpt.read_state_dict(root_p / "good2")
        out["read_keys"] = (sorted(got["optim"]["state"]), sorted(got["rank0"]), sorted(got["rank1"]))
        out["read_equal"] = all(
            torch.equal(got["optim"]["state"][k]["exp_avg"], v["exp_avg"]) for k, v in state["optim"]["state"].items()
        )
        loaded = _good_state(rank)
        for v in loaded["optim"]["state"].values():
            v["exp_avg"].zero_()
        loaded[f"rank{rank}"][rank].zero_()
        asyncckpt.load(loaded, root_p / "good2")
        out["load_equal"] = all(
            torch.equal(loaded["optim"]["state"][k]["exp_avg"], v["exp_avg"])
            for k, v in state["optim"]["state"].items()
        ) and torch.equal(loaded[f"rank{rank}"][rank], torch.full((2,), rank))
    finally:
        queue.close()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("caller", ["temporal", "persistent"])
def test_entries_that_differ_across_ranks_are_refused_on_every_rank(tmp_path: Path, caller: str) -> None:
    results = run_ranks(_rank_keys, 2, str(tmp_path), caller == "persistent", timeout=200, start_method="forkserver")
    expected = {
        "tensor or value": r"'x' differs across ranks: a tensor float32\[3\] on rank 0, a non-tensor value on rank 1",
        "shape": r"'x' differs across ranks: a tensor float32\[3\] on rank 0, a tensor float32\[4\] on rank 1",
        "rank of shape": r"'x' differs across ranks: a tensor float32\[4\] on rank 0, a tensor float32\[2x2\]",
        "dtype": r"'x' differs across ranks: a tensor float32\[3\] on rank 0, a tensor float64\[3\] on rank 1",
        "key type": r"'x\.0' differs across ranks: its dict keys at positions \[1\] are int on rank 0, "
        r"at \[\] on rank 1",
    }
    for rank, out in enumerate(results):
        for (name, async_op), message in out["errors"].items():
            assert message is not None and re.search(expected[name], message), (rank, name, async_op, message)
        assert not any(out["written"]), (rank, out["written"])
        assert "good" not in out, out["good"]
        assert out["read_keys"] == ([0, 1], [0], [1]), out["read_keys"]
        assert out["read_equal"] and out["load_equal"], out
