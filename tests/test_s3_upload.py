"""The upload side of the object-storage tier (issue 32), against the session's real
S3 server (SeaweedFS): the end-to-end CRC check of the uploads, the process exit with
uploads in flight, and the choice of the step to restore over both tiers.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
from test_s3 import Outcomes, state, uploaded

import asyncckpt
from asyncckpt.cli import main as cli_main
from asyncckpt.io import s3 as s3tier

from helpers import assert_same, flip_byte, open_fd_targets, zeroed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def remote(s3_server, monkeypatch):
    """A fresh prefix of the session's server, and the standard AWS variables for it."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("ASYNCCKPT_FAULT", raising=False)
    return s3_server.make_prefix()


def test_a_local_file_that_differs_from_its_manifest_is_not_uploaded(remote, tmp_path):
    """End to end: the bytes read for the upload are checked against the manifest's
    CRC-32s (computed at save time) before the object completes; no marker."""
    root = tmp_path / "r"
    with asyncckpt.CheckpointManager(root) as manager:  # saved without the upload tier
        manager.save(1, state(1, 20.0))  # 20 MiB: a multipart upload (parts of 16 MiB)
    data = root / "step_00000001" / "__0_0.distcp"
    with open(data, "r+b") as f:  # one bit, the same size: only the CRC-32s can tell
        f.seek(data.stat().st_size - (1 << 20))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    errors: list = []
    with asyncckpt.CheckpointManager(root, upload_to=remote, callback=errors.append) as manager:
        uploaded(manager)  # the resume at start uploads step 1
        with pytest.warns(asyncckpt.UploadWarning, match="do not match the CRC-32 of its manifest.*not uploaded"):
            manager.maybe_finalize()
        assert manager.remote_steps() == []
    assert [type(e) for e in errors] == [asyncckpt.UploadError] and errors[0].step == 1
    tier = s3tier.S3Tier(remote)
    assert tier.steps() == [] and tier.head(1, "__0_0.distcp") is None  # its multipart upload was aborted
    with pytest.raises(asyncckpt.CheckpointNotFoundError):
        asyncckpt.read_state_dict(f"{remote}/step_00000001")


#: A script that saves steps with ``upload_to`` and exits without ``close()``.
_EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch, asyncckpt
    root, url, steps = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    manager = asyncckpt.CheckpointManager(root, upload_to=url)
    for step in steps:
        manager.save(step, {"w": torch.full((1 << 16,), float(step))})
    if sys.argv[4] == "committed":   # else pending at exit: the exit commits them, then uploads
        manager.maybe_finalize(blocking=True)
    globals()["keep"] = manager   # alive until the exit: no close()
    print("saved", flush=True)
""")


def _exit_run(
    s3_server, root, url: str, steps: str, when: str, **env: str
) -> tuple[subprocess.CompletedProcess, float]:
    environ = {**os.environ, **s3_server.env(), "PYTHONPATH": ROOT, **env}
    environ.pop("AWS_PROFILE", None)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(root), url, steps, when],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, time.monotonic() - start


def test_exit_without_close_uploads_the_last_saves(s3_server, remote, tmp_path):
    done, _ = _exit_run(s3_server, tmp_path / "r", remote, "1,2", "pending", ASYNCCKPT_EXIT_TIMEOUT_S="60")
    assert done.returncode == 0, done.stderr
    assert s3tier.S3Tier(remote).steps() == [1, 2], done.stderr  # not silently dropped at exit
    assert "did not" not in done.stderr


def test_exit_without_close_is_bounded_and_names_the_steps_not_uploaded(s3_server, remote, tmp_path):
    root = tmp_path / "r"
    done, took = _exit_run(
        s3_server, root, remote, "1,2", "committed", ASYNCCKPT_EXIT_TIMEOUT_S="1", ASYNCCKPT_FAULT="upload:sleep=40"
    )
    assert done.returncode == 0, done.stderr
    assert took < 35, (took, done.stderr)  # not the failpoint's 40 s: the exit's bound
    assert "step 1" in done.stderr and "did not finish within the exit's bound" in done.stderr, done.stderr
    assert "step 2" in done.stderr and "did not start within the exit's bound" in done.stderr, done.stderr
    tier = s3tier.S3Tier(remote)
    assert tier.steps() == []  # cancelled before the marker: absent remotely
    with asyncckpt.CheckpointManager(root, upload_to=remote) as manager:  # the next start uploads both
        uploaded(manager)
        assert manager.remote_steps() == [1, 2]
    out = asyncckpt.read_state_dict(f"{remote}/step_00000002")
    assert torch.equal(out["w"], torch.full((1 << 16,), 2.0))


# ----------------------------------------------------------------------------- restore over both tiers
def test_restore_takes_the_save_committed_last_over_both_tiers(remote, tmp_path):
    """Not the larger step number: the save committed last (a rollback reuses steps)."""
    older = tmp_path / "older"  # a root whose newest save (step 30) precedes the bucket's
    with asyncckpt.CheckpointManager(older) as manager:
        manager.save(30, state(30, 0.1))
    root = tmp_path / "run"
    with asyncckpt.CheckpointManager(root, upload_to=remote, keep_last=1) as manager:
        manager.save(20, state(20, 0.1))
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
    with asyncckpt.CheckpointManager(root, keep_last=1) as manager:  # restarted at step 10: saves 11, not uploaded
        manager.save(11, state(11, 0.1))
    assert asyncckpt.CheckpointManager(root, read_only=True).steps() == [11]
    assert s3tier.S3Tier(remote).steps() == [20]

    run = asyncckpt.CheckpointManager(root, upload_to=remote, read_only=True)
    try:
        assert run.latest_step() == 11  # local, saved after 20
        target = zeroed(state(11, 0.1))
        assert run.load(target) == 11
        assert_same(state(11, 0.1), target)
    finally:
        run.close()
    behind = asyncckpt.CheckpointManager(older, upload_to=remote, read_only=True)
    try:
        assert behind.latest_step() == 20  # the bucket's, saved after 30
        target = zeroed(state(20, 0.1))
        assert behind.load(target) == 20
        assert_same(state(20, 0.1), target)
    finally:
        behind.close()


def test_restore_over_three_tiers_local_root_and_bucket(remote, tmp_path):
    """A local tier, the root and the bucket together (issues 31 and 32): the newest step
    restores from wherever it is; a local copy that fails its CRC-32s falls back to the
    bucket when the root is gone; a fresh machine restores from the bucket. The
    persistent tier's result names the URL it read."""
    root, node = tmp_path / "root", tmp_path / "node0"
    tier = asyncckpt.LocalTier(dir=node, every=1, replicas=0)
    with asyncckpt.CheckpointManager(root, local=tier, upload_to=remote) as manager:
        assert manager.local is not None
        manager.save(4, state(4, 0.5))
        manager.maybe_finalize(blocking=True)
        for step in (5, 6):
            manager.local.save(step, state(step, 0.5))
            assert manager.local.maybe_finalize(blocking=True) == [step]
        uploaded(manager)
    assert s3tier.S3Tier(remote).steps() == [4]
    url = f"{remote}/step_00000004"

    def restore(step: int) -> asyncckpt.RestoreResult:
        with asyncckpt.CheckpointManager(root, local=tier, upload_to=remote) as manager:
            target = zeroed(state(step, 0.5))
            result = manager.restore(target)
        assert result is not None and result.step == step, result
        assert_same(state(step, 0.5), target)
        return result

    shutil.rmtree(root)  # the shared root lost: the local tier is newer than the bucket
    result = restore(6)
    assert (result.tier, result.source, result.peers) == ("local", "local", {}), result
    (data,) = (node / "rank_00000" / "step_00000006").glob("*.distcp")
    flip_byte(data, data.stat().st_size // 2)
    shutil.rmtree(root)  # (the restore's manager made it again, empty)
    result = restore(4)  # no replica: the bucket, not the root (empty)
    assert (result.tier, result.location) == ("persistent", url), result
    assert "checksum mismatch" in str(result) and url in str(result), result
    shutil.rmtree(root)
    shutil.rmtree(node)  # a fresh machine: nothing local at all
    result = restore(4)
    assert (result.tier, result.location, result.notes) == ("persistent", url, ()), result


def test_a_prefix_in_use_by_another_job_is_refused_and_its_steps_kept(remote, tmp_path, capsys):
    """Two jobs (two roots) given one prefix at once: the second's uploads are refused,
    naming the first; the first's step stays bitwise its own (not overwritten by the
    second's step of the same number), and the prefix is free once the first closes."""
    mine, theirs = Outcomes(), Outcomes()
    first = asyncckpt.CheckpointManager(tmp_path / "a", upload_to=remote, callback=mine)
    try:
        first.save(1, state(1, 0.1))
        first.maybe_finalize(blocking=True)
        uploaded(first)
        lease = s3tier.S3Tier(remote).read_lease()
        assert lease is not None and lease.root == str(tmp_path / "a") and lease.holds()
        assert cli_main(["ls", remote]) == 0  # who uploads here
        assert f"lease: the job of root {tmp_path / 'a'} (host " in capsys.readouterr().out
        with asyncckpt.CheckpointManager(tmp_path / "b", upload_to=remote, callback=theirs) as second:
            second.save(1, state(100, 0.1))  # the same step number, other values
            second.save(2, state(2, 0.1))
            second.maybe_finalize(blocking=True)
            uploaded(second)
            with pytest.warns(asyncckpt.UploadWarning, match=r"refused: .* is in use by the job of root .*[/]a "):
                second.maybe_finalize()
            assert second.steps() == [1, 2]  # its local tier is intact
        refused = [o for o in theirs.items if isinstance(o, asyncckpt.UploadError)]
        assert sorted(o.step or 0 for o in refused) == [1, 2]
        assert s3tier.S3Tier(remote).steps() == [1]
        target = zeroed(state(1, 0.1))
        asyncckpt.load(target, f"{remote}/step_00000001")
        assert_same(state(1, 0.1), target)  # the first job's step, bitwise
        first.save(3, state(3, 0.1))  # the first job goes on uploading
        first.maybe_finalize(blocking=True)
        uploaded(first)
        assert s3tier.S3Tier(remote).steps() == [1, 3]
    finally:
        first.close()
    assert not [o for o in mine.items if isinstance(o, asyncckpt.UploadError)]
    assert s3tier.S3Tier(remote).read_lease() is None  # released at close
    with asyncckpt.CheckpointManager(tmp_path / "b", upload_to=remote) as second:  # free now: it uploads
        uploaded(second)  # (the resume: its steps after the newest it finds remotely, step 1)
        assert second.remote_steps() == [1, 2, 3]
        lease = s3tier.S3Tier(remote).read_lease()
        assert lease is not None and lease.root == str(tmp_path / "b")


def test_a_lease_that_lapsed_or_is_this_roots_own_is_taken_over(remote, tmp_path, monkeypatch, caplog):
    """A lease not renewed for LEASE_TTL_S (a job that died) is taken over, with a
    warning; one of this very root (the same job restarted after a crash) at once."""
    tier = s3tier.S3Tier(remote)
    assert tier.write_lease("/another/job", replaces=None)
    monkeypatch.setattr(s3tier, "LEASE_TTL_S", 2.0)
    time.sleep(3.0)  # (whole seconds: the server's clock)
    lapsed = tier.read_lease()
    assert lapsed is not None and not lapsed.holds()
    with caplog.at_level("WARNING", logger="asyncckpt"):
        with asyncckpt.CheckpointManager(tmp_path / "r", upload_to=remote) as manager:
            manager.save(1, state(1, 0.1))
            manager.maybe_finalize(blocking=True)
            uploaded(manager)
            manager.maybe_finalize()  # (no UploadWarning: pytest's filterwarnings makes one an error)
            assert manager.remote_steps() == [1]
    assert "taken over from the job of root /another/job" in caplog.text
    monkeypatch.setattr(s3tier, "LEASE_TTL_S", 300.0)
    assert tier.write_lease(str(tmp_path / "r"), replaces=tier.read_lease())  # this root's, fresh: as a crash leaves it
    with asyncckpt.CheckpointManager(tmp_path / "r", upload_to=remote) as manager:
        manager.save(2, state(2, 0.1))
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
        manager.maybe_finalize()
        assert manager.remote_steps() == [1, 2]


def _wait_for(path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def test_of_two_jobs_that_find_a_prefix_free_at_once_exactly_one_takes_it(remote, tmp_path, monkeypatch):
    """Two jobs read the free prefix's lease at the same moment (the ``lease`` failpoint
    holds each coordinator between its read and its write): the conditional write lets
    one of them take the prefix; the other reads again and is refused, and the remote
    step is bitwise the winner's. (With plain writes both took it: both uploaded step 1,
    one over the other.)"""
    reached, go = tmp_path / "reached", tmp_path / "go"
    monkeypatch.setenv("ASYNCCKPT_FAULT", f"lease:touch={reached};lease:wait={go}")
    outcomes = {"a": Outcomes(), "b": Outcomes()}
    states = {"a": state(1, 0.1), "b": state(100, 0.1)}
    managers = {}
    try:
        for job in ("a", "b"):
            managers[job] = asyncckpt.CheckpointManager(tmp_path / job, upload_to=remote, callback=outcomes[job])
            managers[job].save(1, states[job])
            managers[job].maybe_finalize(blocking=True)
            _wait_for(reached)  # this job's coordinator read the lease: none
            reached.unlink()
        go.touch()
        for manager in managers.values():
            uploaded(manager)
        won = [job for job in managers if outcomes[job].of(asyncckpt.UploadResult)]
        lost = [job for job in managers if outcomes[job].of(asyncckpt.UploadError)]
        assert len(won) == 1 and len(lost) == 1, {job: outcomes[job].items for job in managers}
        with pytest.warns(asyncckpt.UploadWarning, match=rf"refused: .* is in use by the job of root .*[/]{won[0]} "):
            managers[lost[0]].maybe_finalize()
        lease = s3tier.S3Tier(remote).read_lease()
        assert lease is not None and lease.root == str(tmp_path / won[0])
        target = zeroed(state(1, 0.1))
        asyncckpt.load(target, f"{remote}/step_00000001")
        assert_same(states[won[0]], target)
    finally:
        go.touch()
        for manager in managers.values():
            manager.close()


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_uploads_run_off_the_training_thread_at_a_lower_priority(remote, tmp_path):
    seen: list[tuple[str, int]] = []

    def on_outcome(outcome) -> None:
        if isinstance(outcome, (asyncckpt.UploadResult, asyncckpt.UploadError)):
            seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with asyncckpt.CheckpointManager(tmp_path / "n", upload_to=remote, callback=on_outcome) as manager:
        manager.save(1, state(1, 0.25))
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
        assert manager.remote_steps() == [1]
    assert seen == [("asyncckpt-upload", max(10, before))]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the training thread's is its own


def _agents(pid: int | None = None) -> list:
    """The upload agents of process ``pid`` (default: this one): its children running
    ``asyncckpt.io.s3_agent``."""
    import psutil

    found = []
    for child in psutil.Process(pid).children():
        try:
            if "asyncckpt.io.s3_agent" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def test_the_bytes_go_up_from_an_upload_process_and_its_death_fails_that_step_only(remote, tmp_path, monkeypatch):
    """The failpoint ``upload`` is reached in the upload process: ``kill`` kills it (from a
    thread of the training process it would kill the training process): that step's
    upload fails with the reason, the local tier and training go on, the next step's
    upload starts a new upload process; ``close()`` stops it."""
    outcomes = Outcomes()
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with asyncckpt.CheckpointManager(tmp_path / "k", upload_to=remote, callback=outcomes) as manager:
        manager.save(1, state(1, 0.25))
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
        (agent,) = _agents()
        assert agent.nice() == max(10, before)  # below the training process, as the upload thread
        monkeypatch.setenv("ASYNCCKPT_FAULT", "upload:kill")
        manager.save(2, state(2, 0.25))
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
        monkeypatch.delenv("ASYNCCKPT_FAULT")
        with pytest.warns(asyncckpt.UploadWarning, match=r"upload process \(pid \d+\) ended \(signal 9 \(SIGKILL\)\)"):
            manager.maybe_finalize()
        assert not agent.is_running()
        manager.save(3, state(3, 0.25))
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
        assert manager.remote_steps() == [1, 3]
        assert manager.steps() == [1, 2, 3]  # the local tier is intact
        assert len(_agents()) == 1
    assert not _agents()
    assert [e.step for e in outcomes.of(asyncckpt.UploadError)] == [2]
    assert [r.step for r in outcomes.of(asyncckpt.UploadResult)] == [1, 3]
    assert_same(state(2, 0.25), asyncckpt.read_state_dict(tmp_path / "k" / "step_00000002"))


def test_upload_process_false_uploads_from_a_thread_of_the_training_process(remote, tmp_path):
    with asyncckpt.CheckpointManager(tmp_path / "t", upload_to=remote, upload_process=False) as manager:
        manager.save(1, state(1, 0.25))
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
        assert manager.remote_steps() == [1]
        assert not _agents()
    assert_same(state(1, 0.25), asyncckpt.read_state_dict(f"{remote}/step_00000001"))


def test_the_upload_process_ends_with_a_killed_training_process(remote, tmp_path):
    """A training process SIGKILLed mid-upload: its upload process reads end of file on
    its socket, cancels the upload (no marker) and exits instead of living on as an
    orphan; the next start uploads the step."""
    import psutil

    root = tmp_path / "r"
    code = textwrap.dedent(
        f"""
        import time, torch, asyncckpt
        manager = asyncckpt.CheckpointManager({str(root)!r}, upload_to={remote!r})
        manager.save(1, {{"w": torch.full((1 << 16,), 1.0)}})
        manager.maybe_finalize(blocking=True)
        print("saved", flush=True)
        time.sleep(120)
        """
    )
    env = {**os.environ, "ASYNCCKPT_FAULT": "upload:sleep=60", "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    agents: list = []
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saved"
        deadline = time.monotonic() + 60
        while not agents:  # the upload process, held at the failpoint after the data objects
            assert time.monotonic() < deadline, "no upload process"
            agents = _agents(proc.pid)
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    _, alive = psutil.wait_procs(agents, timeout=20)
    for agent in alive:
        agent.kill()
    assert not alive, "the upload process outlived its training process"
    assert s3tier.S3Tier(remote).steps() == []  # no marker
    with asyncckpt.CheckpointManager(root, upload_to=remote) as manager:
        uploaded(manager)
        assert manager.remote_steps() == [1]


# ----------------------------------------------------------------------------- uploads behind the saves
def _held_steps(root) -> set[int]:
    """The steps of ``root`` whose files this process holds open, also those local
    retention removed (``.step_N.deleting-*/... (deleted)``: their bytes stay on disk
    while a descriptor is open)."""
    pattern = re.compile(rf"{re.escape(str(root))}/\.?step_(\d+)")
    return {int(found.group(1)) for found in map(pattern.match, open_fd_targets()) if found}


def test_uploads_behind_the_saves_drop_the_waiting_steps_for_the_newest(remote, tmp_path, monkeypatch, caplog):
    """An upload slower than the saves (1 s each, saves every few ms): the steps waiting
    for their upload never exceed MAX_WAITING_UPLOADS (before, every save added one, each
    holding its files open after local retention removed them: disk and descriptors
    without bound); the waiting steps are dropped for the newest, which goes up; each
    step has one outcome (uploaded or skipped), a skip is no failure."""
    from asyncckpt.upload import MAX_WAITING_UPLOADS

    monkeypatch.setenv("ASYNCCKPT_FAULT", "upload:sleep=0.5")
    root = tmp_path / "r"
    outcomes = Outcomes()
    most_held = 0
    with caplog.at_level("INFO", logger="asyncckpt"):
        with asyncckpt.CheckpointManager(root, upload_to=remote, keep_last=2, callback=outcomes) as manager:
            for step in range(1, 13):
                manager.save(step, state(step, 0.25))
                manager.maybe_finalize(blocking=True)
                most_held = max(most_held, len(_held_steps(root)))
                time.sleep(0.02)
            uploaded(manager)
            with warnings.catch_warnings():
                warnings.simplefilter("error", asyncckpt.UploadWarning)
                manager.maybe_finalize()  # a skip is no failure: no UploadWarning
            remote_steps = manager.remote_steps()
    assert most_held <= MAX_WAITING_UPLOADS + 1, most_held  # the waiting ones and the one in flight
    done = {o.step: o for o in outcomes.items if not isinstance(o, asyncckpt.SaveResult)}
    assert len(done) == len([o for o in outcomes.items if not isinstance(o, asyncckpt.SaveResult)]) == 12
    ups = sorted(s for s, o in done.items() if isinstance(o, asyncckpt.UploadResult))
    skips = sorted(s for s, o in done.items() if isinstance(o, asyncckpt.UploadSkipped))
    assert sorted(ups + skips) == list(range(1, 13)) and skips, done  # no UploadError
    assert 12 in ups and remote_steps == ups  # the newest went up; a skipped step is absent remotely
    assert all(done[s].superseded_by > s and done[s].url == f"{remote}/step_{s:08d}" for s in skips)
    warned = [r for r in caplog.records if "are behind the saves" in r.getMessage()]
    assert [r.levelname for r in warned] == ["WARNING"] + ["INFO"] * (len(skips) - 1)
    assert_same(state(12, 0.25), asyncckpt.read_state_dict(f"{remote}/step_00000012"))


def _two_ranks_behind(rank: int, world_size: int, root: str, url: str, env: dict[str, str]) -> dict:
    os.environ.update(env)
    if rank == 1:  # the slow rank: the coordinator waits for its objects of each step
        os.environ["ASYNCCKPT_FAULT"] = "upload:sleep=0.5"
    outcomes = Outcomes()
    most_held = 0
    started = time.monotonic()
    with asyncckpt.CheckpointManager(root, upload_to=url, keep_last=2, callback=outcomes, upload_timeout_s=60) as m:
        for step in range(1, 11):
            g = torch.Generator().manual_seed(10 * step + rank)
            m.save(step, {f"own{rank}": torch.randn(1 << 16, generator=g), "step": step})
            m.maybe_finalize(blocking=True)
            most_held = max(most_held, len(_held_steps(root)))
        assert m.wait_uploads(60)
        took = time.monotonic() - started
    kinds = {o.step: type(o).__name__ for o in outcomes.items if not isinstance(o, asyncckpt.SaveResult)}
    errors = [str(o) for o in outcomes.items if isinstance(o, asyncckpt.UploadError)]
    return {"kinds": kinds, "errors": errors, "held": most_held, "took": took}


def test_two_ranks_behind_the_saves_drop_the_same_steps(remote, tmp_path):
    """Rank 1 uploads slower than the saves; the coordinator waits for its objects of
    each step. Every rank drops the same waiting steps (decided together in the save's
    plan), so the coordinator never waits for a step rank 1 dropped (it would wait
    until upload_timeout_s and fail it), and the newest step goes up from both."""
    from asyncckpt.upload import MAX_WAITING_UPLOADS

    from dist_utils import preload_forkserver, run_ranks

    preload_forkserver()
    env = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
    results = run_ranks(
        _two_ranks_behind, 2, str(tmp_path / "root"), remote, env, timeout=150, start_method="forkserver"
    )
    for r in results:
        assert not r["errors"], r["errors"]
        assert r["held"] <= MAX_WAITING_UPLOADS + 1, r
        assert sorted(r["kinds"]) == list(range(1, 11)), r
        assert r["took"] < 50, r  # never a wait for upload_timeout_s (60 s)
    coordinator, slow = (r["kinds"] for r in results)
    skipped = {s for s, kind in coordinator.items() if kind == "UploadSkipped"}
    # (rank 1 may finish, in vain, a step it started before the decision reached it)
    assert skipped and {s for s, kind in slow.items() if kind == "UploadSkipped"} <= skipped
    remote_steps = s3tier.S3Tier(remote).steps()
    assert remote_steps == sorted(set(range(1, 11)) - skipped) and remote_steps[-1] == 10
    got = asyncckpt.read_state_dict(f"{remote}/step_00000010")
    for rank in (0, 1):
        assert torch.equal(got[f"own{rank}"], torch.randn(1 << 16, generator=torch.Generator().manual_seed(100 + rank)))
