"""Two-rank tests of the framework layer (AsyncCallsQueue over real gloo ranks).

Starting ranks costs seconds, so each caller (``persistent=False``: TemporalAsyncCaller,
``persistent=True``: PersistentAsyncCaller) gets one ``run_ranks`` run (the module-scoped
``rank_results`` fixture) that plays every scenario in turn, in the same order on both
ranks, and returns what each rank saw; the tests below assert on it, one acceptance item
each. Every scenario uses fresh queues and ends with a barrier on the default group.

The async functions come from ``test_framework`` (module level, torch-free), so that the
persistent workers the ranks start can unpickle them.
"""

from __future__ import annotations

import functools
import os
import time
import traceback
from typing import Any

import pytest
from test_framework import (
    FAIL_DEADLINE_S,
    echo,
    exit_with_code_3,
    kill_self_with_sigkill,
    live_children,
    preload_raises,
    raise_value_error,
    record_result,
    return_pid,
    sleep_then_return,
)

from asyncckpt.async_utils.request import AsyncRequest
from asyncckpt.errors import CheckpointException

from dist_utils import run_ranks

WORLD_SIZE = 2


def sleep_then_touch(seconds, path, value):
    """Sleep, then create ``path`` (if given) and return ``value``."""
    time.sleep(seconds)
    if path is not None:
        with open(path, "w") as f:
            f.write("done")
    return value


def _summary(exc):
    """What every rank must agree on about a CheckpointException (picklable)."""
    if exc is None:
        return None
    return {"type": type(exc).__name__, "call_idx": exc.call_idx, "failures": dict(exc.failures), "text": str(exc)}


def _queue(persistent):
    from asyncckpt.async_utils.calls_queue import AsyncCallsQueue

    return AsyncCallsQueue(persistent=persistent)


# --------------------------------------------------------------------------- scenarios (in ranks)
def _scenario_completion_sync(rank, persistent, tmpdir):
    """Rank 0's call is quick, rank 1's is slow: nobody finalizes until both are done."""
    import torch.distributed as dist

    q = _queue(persistent)
    try:
        marker = os.path.join(tmpdir, "rank1-done")
        seen: dict[Any, Any] = {}

        def on_finalize():
            seen.update(rank1_done=os.path.exists(marker), result=q.get_result(0))

        seconds = 0.05 if rank == 0 else 1.5
        req = AsyncRequest(
            sleep_then_touch, (seconds, marker if rank == 1 else None, f"value-{rank}"), finalize_fns=[on_finalize]
        )
        idx = q.schedule_async_request(req)
        local_done = q.wait_local(idx, timeout=30) if rank == 0 else None
        nonblocking = q.maybe_finalize_async_calls()
        unfinalized = q.get_num_unfinalized_calls()
        blocking = q.maybe_finalize_async_calls(blocking=True)
        gloo = q.sync.gloo
        info = dict(
            idx=idx,
            local_done=local_done,
            nonblocking=nonblocking,
            unfinalized=unfinalized,
            blocking=blocking,
            seen=seen,
            sync=(q.sync.rank, q.sync.world_size, q.sync.active),
            gloo_backend=str(dist.get_backend(gloo)),
            gloo_is_default=gloo is dist.group.WORLD,
        )
        q.close()
        return info
    finally:
        q.close(abort=True)


def _scenario_fifo_by_call_idx(rank, persistent, tmpdir):
    """Calls of different durations (different per rank): finalized in call_idx order, each
    finalize seeing its own call's result."""
    q = _queue(persistent)
    try:
        durations = [0.6, 0.05, 0.3] if rank == 0 else [0.3, 0.05, 0.6]
        got: list[Any] = []
        idxs = []
        for i, seconds in enumerate(durations):
            req = AsyncRequest(
                sleep_then_return,
                (seconds, f"rank{rank}-call{i}"),
                finalize_fns=[functools.partial(record_result, q, i, got)],
            )
            idxs.append(q.schedule_async_request(req))
        finalized = q.maybe_finalize_async_calls(blocking=True)
        q.close()
        return dict(idxs=idxs, finalized=finalized, got=got)
    finally:
        q.close(abort=True)


def _scenario_until(rank, persistent, tmpdir):
    q = _queue(persistent)
    try:
        got: list[Any] = []
        for i in range(3):
            q.schedule_async_request(
                AsyncRequest(
                    sleep_then_return,
                    (0.05 * (rank + 1), i),
                    finalize_fns=[functools.partial(record_result, q, i, got)],
                )
            )
        before = q.get_num_unfinalized_calls()
        first = q.maybe_finalize_async_calls(blocking=True, until=1)
        middle = q.get_num_unfinalized_calls()
        rest = q.maybe_finalize_async_calls(blocking=True)
        after = q.get_num_unfinalized_calls()
        q.close()
        return dict(before=before, first=first, middle=middle, rest=rest, after=after, got=got)
    finally:
        q.close(abort=True)


def _scenario_no_dist(rank, persistent, tmpdir):
    """Rank 1 finalizes with no_dist=True while rank 0 calls nothing: no collective, no hang."""
    q = _queue(persistent)
    try:
        got: list[Any] = []
        fn_args = [
            (sleep_then_return, (0.05, f"ok-{rank}")),
            (raise_value_error, ("rank1-no-dist",)) if rank == 1 else (sleep_then_return, (0.05, "ok-0")),
        ]
        for i, (fn, args) in enumerate(fn_args):
            q.schedule_async_request(AsyncRequest(fn, args, finalize_fns=[functools.partial(record_result, q, i, got)]))
        rank1_done = os.path.join(tmpdir, "rank1-finalized")
        rank1_seen = None
        if rank == 0:  # calls nothing until rank 1 has finalized on its own
            deadline = time.monotonic() + 20
            while not os.path.exists(rank1_done) and time.monotonic() < deadline:
                time.sleep(0.02)
            rank1_seen = os.path.exists(rank1_done)
        else:
            assert q.wait_local(0, timeout=30) and q.wait_local(1, timeout=30)
        t0 = time.monotonic()
        exc = None
        finalized = q.maybe_finalize_async_calls(blocking=True, no_dist=True) if rank == 0 else []
        if rank == 1:
            finalized = q.maybe_finalize_async_calls(no_dist=True, until=0)
            try:
                finalized += q.maybe_finalize_async_calls(no_dist=True)
            except CheckpointException as e:
                exc = e
        t1 = time.monotonic()
        if rank == 1:
            with open(rank1_done, "w") as f:
                f.write("done")
        left = q.get_num_unfinalized_calls()
        q.close()  # nothing pending on either rank: no collective
        return dict(t0=t0, t1=t1, finalized=finalized, exc=_summary(exc), got=got, left=left, rank1_seen=rank1_seen)
    finally:
        q.close(abort=True)


def _scenario_close(rank, persistent, tmpdir):
    """close() finalizes the pending calls on every rank, stops the worker, is idempotent."""
    q = _queue(persistent)
    try:
        got: list[Any] = []
        for i in range(2):
            q.schedule_async_request(
                AsyncRequest(
                    sleep_then_return,
                    (0.3 if rank == 0 else 0.1, f"c{i}"),
                    finalize_fns=[functools.partial(record_result, q, i, got)],
                )
            )
        q.close()
        info = dict(
            got=got,
            closed=q.closed,
            left=q.get_num_unfinalized_calls(),
            worker_pid=q.caller.worker_pid if persistent else None,
            children=[p.pid for p in live_children()],
        )
        q.close()
        q.close(abort=True)
        try:
            q.schedule_async_request(AsyncRequest(echo))
            info["schedule_after_close"] = "returned"
        except RuntimeError:
            info["schedule_after_close"] = "RuntimeError"
        return info
    finally:
        q.close(abort=True)


def _failure_plan(rank):
    """(kind, failing rank, request on this rank) for each failure kind, in order."""
    return [
        (
            "raises",
            1,
            AsyncRequest(raise_value_error, ("rank1-boom",))
            if rank == 1
            else AsyncRequest(sleep_then_return, (0.2, "fine")),
        ),
        (
            "sigkill",
            1,
            AsyncRequest(kill_self_with_sigkill) if rank == 1 else AsyncRequest(sleep_then_return, (0.2, "fine")),
        ),
        ("exit3", 0, AsyncRequest(exit_with_code_3) if rank == 0 else AsyncRequest(sleep_then_return, (0.2, "fine"))),
        (
            "preload_raises",
            0,
            AsyncRequest(echo, preload_fn=preload_raises)
            if rank == 0
            else AsyncRequest(sleep_then_return, (0.2, "fine")),
        ),
    ]


def _scenario_failures(rank, persistent, tmpdir):
    """One queue; for each failure kind: a failing call (on one rank), then a good one."""
    q = _queue(persistent)
    try:
        if persistent:
            q.caller.start()  # so that num_starts counts restarts only
        out = {}
        for kind, _, req in _failure_plan(rank):
            starts_before = q.caller.num_starts if persistent else None
            ran: list[Any] = []
            req.add_finalize_fn(functools.partial(ran.append, kind))
            t0 = time.monotonic()
            idx = q.schedule_async_request(req)
            schedule_s = time.monotonic() - t0
            exc = None
            try:
                q.maybe_finalize_async_calls(blocking=True)
            except CheckpointException as e:
                exc = e
            elapsed = time.monotonic() - t0
            got: list[Any] = []
            nxt = q.schedule_async_request(
                AsyncRequest(return_pid, finalize_fns=[functools.partial(record_result, q, idx + 1, got)])
            )
            next_finalized = q.maybe_finalize_async_calls(blocking=True)
            out[kind] = dict(
                idx=idx,
                schedule_s=schedule_s,
                exc=_summary(exc),
                elapsed=elapsed,
                ran=ran,
                next_idx=nxt,
                next_finalized=next_finalized,
                next_got=got,
                starts_before=starts_before,
                starts_after=q.caller.num_starts if persistent else None,
                left=q.get_num_unfinalized_calls(),
            )
        q.close()
        return out
    finally:
        q.close(abort=True)


def _scenario_stale_result(rank, persistent, tmpdir):
    """Rank 1 fails fast while rank 0's call still runs (non-blocking polls): both raise at
    once; rank 0's late result of the failed call never reaches the next call's finalize."""
    q = _queue(persistent)
    try:
        if persistent:  # warm workers, so that rank 1 fails at once
            q.schedule_async_request(AsyncRequest(echo))
            q.maybe_finalize_async_calls(blocking=True)
        ran: list[Any] = []
        req = (
            AsyncRequest(raise_value_error, ("rank1-fast",))
            if rank == 1
            else AsyncRequest(sleep_then_return, (3.0, "stale"))
        )
        req.add_finalize_fn(functools.partial(ran.append, 0))
        idx = q.schedule_async_request(req)
        t0 = time.monotonic()
        exc = None
        polls = 0
        for polls in range(1, 2001):  # noqa: B007 - counted, read after the loop; bounded, rank-symmetric (no time-based exit)
            try:
                q.maybe_finalize_async_calls()
            except CheckpointException as e:
                exc = e
                break
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
        still_running = q.caller.is_running(idx)
        got: list[Any] = []
        q.schedule_async_request(
            AsyncRequest(
                sleep_then_return,
                (0.05, f"fresh-{rank}"),
                finalize_fns=[functools.partial(record_result, q, idx + 1, got)],
            )
        )
        finalized = q.maybe_finalize_async_calls(blocking=True)
        q.close()
        return dict(
            idx=idx,
            exc=_summary(exc),
            elapsed=elapsed,
            polls=polls,
            still_running=still_running,
            ran=ran,
            finalized=finalized,
            got=got,
        )
    finally:
        q.close(abort=True)


SCENARIOS = [
    ("completion_sync", _scenario_completion_sync),
    ("fifo", _scenario_fifo_by_call_idx),
    ("until", _scenario_until),
    ("no_dist", _scenario_no_dist),
    ("close", _scenario_close),
    ("failures", _scenario_failures),
    ("stale_result", _scenario_stale_result),
]


def _rank_main(rank, world_size, persistent, tmpdir):
    import torch.distributed as dist

    results: dict[str, Any] = {}
    for name, scenario in SCENARIOS:
        os.makedirs(os.path.join(tmpdir, name), exist_ok=True)
        try:
            results[name] = {"ok": True, "value": scenario(rank, persistent, os.path.join(tmpdir, name))}
        except BaseException:  # noqa: BLE001 - reported per scenario to the test
            results[name] = {"ok": False, "value": traceback.format_exc()}
        dist.barrier()
    results["children_at_end"] = [p.pid for p in live_children()]
    return results


# --------------------------------------------------------------------------- tests (parent)
@pytest.fixture(scope="module", params=[False, True], ids=["temporal", "persistent"])
def rank_results(request, tmp_path_factory):
    """Run every scenario on 2 gloo ranks with one caller; ``{name: [rank0, rank1]}``."""
    tmpdir = str(tmp_path_factory.mktemp("ranks"))
    per_rank = run_ranks(_rank_main, WORLD_SIZE, request.param, tmpdir, timeout=40, start_method="forkserver")
    return {
        "persistent": request.param,
        **{name: [per_rank[r][name] for r in range(WORLD_SIZE)] for name in per_rank[0]},
    }


def _values(rank_results, name):
    """The per-rank values of scenario ``name``; fails with the ranks' tracebacks."""
    entries = rank_results[name]
    errors = {r: e["value"] for r, e in enumerate(entries) if not e["ok"]}
    assert not errors, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors.items())
    return [e["value"] for e in entries]


@pytest.mark.timeout(60)
def test_completion_is_agreed_on_by_all_ranks_over_a_dedicated_gloo_group(rank_results):
    r0, r1 = _values(rank_results, "completion_sync")
    assert r0["sync"] == (0, 2, True) and r1["sync"] == (1, 2, True)
    assert r0["gloo_backend"] == "gloo" and not r0["gloo_is_default"]
    assert r0["local_done"] is True  # rank 0's own call was done...
    assert r0["nonblocking"] == [] and r1["nonblocking"] == []  # ...but rank 1's was not
    assert r0["unfinalized"] == 1 and r1["unfinalized"] == 1
    assert r0["blocking"] == [0] and r1["blocking"] == [0]
    assert r0["seen"] == {"rank1_done": True, "result": "value-0"}, "rank 0 finalized before rank 1 finished"
    assert r1["seen"] == {"rank1_done": True, "result": "value-1"}


@pytest.mark.timeout(60)
def test_finalize_fns_run_fifo_by_call_idx_with_their_own_results(rank_results):
    for rank, r in enumerate(_values(rank_results, "fifo")):
        assert r["idxs"] == [0, 1, 2]
        assert r["finalized"] == [0, 1, 2]
        assert r["got"] == [(i, f"rank{rank}-call{i}") for i in range(3)]


@pytest.mark.timeout(60)
def test_until_and_num_unfinalized_calls_on_two_ranks(rank_results):
    for r in _values(rank_results, "until"):
        assert (r["before"], r["first"], r["middle"], r["rest"], r["after"]) == (3, [0, 1], 1, [2], 0)
        assert r["got"] == [(0, 0), (1, 1), (2, 2)]


@pytest.mark.timeout(60)
def test_no_dist_finalize_needs_no_other_rank(rank_results):
    r0, r1 = _values(rank_results, "no_dist")
    assert r1["finalized"] == [0] and r1["got"] == [(0, "ok-1")]
    assert r0["rank1_seen"] is True, "rank 1's no_dist finalize did not return while rank 0 called nothing"
    assert r1["t1"] - r1["t0"] < 1.0
    assert r1["t1"] < r0["t0"]
    # with no_dist a failure is decided on this rank alone
    assert r1["exc"]["call_idx"] == 1 and list(r1["exc"]["failures"]) == [1]
    assert "ValueError: rank1-no-dist" in r1["exc"]["failures"][1]
    assert r0["exc"] is None and r0["finalized"] == [0, 1]
    assert r0["got"] == [(0, "ok-0"), (1, "ok-0")]
    assert r0["left"] == 0 and r1["left"] == 0


@pytest.mark.timeout(60)
def test_close_finalizes_pending_calls_on_every_rank_and_stops(rank_results):
    for r in _values(rank_results, "close"):
        assert r["got"] == [(0, "c0"), (1, "c1")]
        assert r["closed"] and r["left"] == 0
        assert r["worker_pid"] is None
        assert r["children"] == []
        assert r["schedule_after_close"] == "RuntimeError"


def _check_failure(rank_results, kind):
    plan = {k: bad for k, bad, _ in _failure_plan(0)}
    bad_rank = plan[kind]
    r0, r1 = (r[kind] for r in _values(rank_results, "failures"))
    for r in (r0, r1):
        assert r["exc"] is not None, f"{kind}: no CheckpointException"
        assert r["elapsed"] < FAIL_DEADLINE_S, f"{kind}: reported after {r['elapsed']:.1f} s"
        assert r["schedule_s"] < 5.0
        assert r["ran"] == [], f"{kind}: finalize_fns of the failed call ran"
        assert r["next_finalized"] == [r["idx"] + 1] and r["next_idx"] == r["idx"] + 1
        assert [i for i, _ in r["next_got"]] == [r["idx"] + 1] and isinstance(r["next_got"][0][1], int)
        assert r["left"] == 0
    assert r0["exc"] == r1["exc"], "the ranks raised different exceptions"
    exc = r0["exc"]
    assert exc["type"] == "CheckpointException"
    assert exc["call_idx"] == r0["idx"] == r1["idx"]
    assert list(exc["failures"]) == [bad_rank], f"{kind}: {exc['failures']}"
    return exc["failures"][bad_rank], (r0, r1)[bad_rank], (r0, r1)[1 - bad_rank]


@pytest.mark.timeout(60)
def test_async_fn_raising_on_one_rank_raises_the_same_exception_on_both(rank_results):
    cause, bad, _good = _check_failure(rank_results, "raises")
    assert "ValueError: rank1-boom" in cause and "Traceback" in cause and "raise_value_error" in cause
    if rank_results["persistent"]:  # an exception does not kill the worker
        assert bad["starts_after"] == bad["starts_before"] == 1


@pytest.mark.timeout(60)
def test_worker_killed_on_one_rank_raises_on_both_and_is_restarted(rank_results):
    cause, bad, good = _check_failure(rank_results, "sigkill")
    assert "SIGKILL" in cause
    if rank_results["persistent"]:
        assert bad["starts_after"] == bad["starts_before"] + 1
        assert good["starts_after"] == good["starts_before"]


@pytest.mark.timeout(60)
def test_worker_exiting_on_one_rank_raises_on_both_and_is_restarted(rank_results):
    cause, bad, good = _check_failure(rank_results, "exit3")
    assert "exited with code 3" in cause
    if rank_results["persistent"]:
        assert bad["starts_after"] == bad["starts_before"] + 1
        assert good["starts_after"] == good["starts_before"]


@pytest.mark.timeout(60)
def test_preload_raising_on_one_rank_never_blocks_schedule_and_raises_on_both(rank_results):
    cause, _bad, _good = _check_failure(rank_results, "preload_raises")
    assert "preload_fn" in cause and "RuntimeError: preload-bad" in cause


@pytest.mark.timeout(60)
def test_failure_on_one_rank_is_reported_at_once_and_a_stale_result_is_dropped(rank_results):
    r0, r1 = _values(rank_results, "stale_result")
    assert r0["exc"] is not None and r0["exc"] == r1["exc"]
    idx = r0["idx"]
    assert r1["idx"] == idx
    assert r0["exc"]["call_idx"] == idx and list(r0["exc"]["failures"]) == [1]
    assert "ValueError: rank1-fast" in r0["exc"]["failures"][1]
    assert r0["polls"] == r1["polls"]
    assert r0["still_running"] is True, "rank 0 learned of rank 1's failure only after its own call ended"
    assert r0["ran"] == [] and r1["ran"] == []
    assert r0["finalized"] == [idx + 1] and r1["finalized"] == [idx + 1]
    assert r0["got"] == [(idx + 1, "fresh-0")], "the failed call's late result reached the next call"
    assert r1["got"] == [(idx + 1, "fresh-1")]


@pytest.mark.timeout(60)
def test_ranks_leave_no_child_process(rank_results):
    assert rank_results["children_at_end"] == [[], []]
