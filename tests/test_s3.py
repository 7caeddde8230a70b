"""Checkpoints in object storage (issue 32), against a real S3 server (SeaweedFS).

The session's server is ``tests/s3_server.py`` (fixture ``s3_server`` in ``conftest.py``);
faults are real: the server killed and restarted, wrong keys, a missing bucket, an
object overwritten through the S3 API.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt.io import s3 as s3tier

from helpers import LogLines, assert_same, zeroed


def test_server_refuses_wrong_credentials(s3_server):
    bucket = s3_server.bucket
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="k", Body=b"v")
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError, match="SignatureDoesNotMatch"):
        s3_server.client(secret_key="wrong", retries=0).get_object(Bucket=bucket, Key="k")


# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def remote(s3_server, monkeypatch):
    """A fresh prefix (``s3://asyncckpt-tests/t-<hex>``) of the session's server, and the
    standard AWS variables pointing at it (the library reads them as any AWS SDK does)."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("ASYNCCKPT_FAULT", raising=False)
    return s3_server.make_prefix()


def state(seed: int, mib: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = int(mib * (1 << 20)) // 4
    return {
        "model": {"w": torch.randn(n // 2, generator=g), "b": torch.randn(n - n // 2, generator=g)},
        "step": seed,
    }


def uploaded(manager, timeout: float = 60) -> None:
    assert manager.wait_uploads(timeout), "uploads did not finish"


class Outcomes:
    """A completion callback that keeps every outcome (saves and uploads)."""

    def __init__(self) -> None:
        self.items: list = []
        self.lock = threading.Lock()

    def __call__(self, outcome) -> None:
        with self.lock:
            self.items.append(outcome)

    def of(self, kind) -> list:
        with self.lock:
            return [o for o in self.items if isinstance(o, kind)]


# ----------------------------------------------------------------------------- upload, restore
def test_upload_then_restore_on_a_fresh_machine(remote, tmp_path):
    outcomes = Outcomes()
    states = {step: state(step) for step in (1, 2)}
    with asyncckpt.CheckpointManager(tmp_path / "a", upload_to=remote, callback=outcomes) as manager:
        for step, sd in states.items():
            manager.save(step, sd)
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
        assert manager.remote_steps() == [1, 2]
    results = outcomes.of(asyncckpt.UploadResult)
    assert [r.step for r in results] == [1, 2]
    assert all(r.url == f"{remote}/step_{r.step:08d}" and r.bytes > 1 << 20 for r in results)
    assert not outcomes.of(asyncckpt.UploadError)
    assert s3tier.S3Tier(remote).read_latest() == 2

    # A fresh machine: an empty local root restores from the bucket, bitwise.
    fresh = asyncckpt.CheckpointManager(tmp_path / "fresh", upload_to=remote)
    try:
        assert fresh.steps() == []
        assert fresh.latest_step() == 2
        target = zeroed(states[2])
        assert fresh.load(target) == 2
        assert_same(states[2], target)
        target = zeroed(states[1])
        assert fresh.load(target, 1) == 1
        assert_same(states[1], target)
    finally:
        fresh.close()
    # The URL read paths, without a manager.
    assert_same(states[1], asyncckpt.read_state_dict(f"{remote}/step_00000001"))
    target = zeroed(states[2])
    asyncckpt.load(target, f"{remote}/step_00000002")
    assert_same(states[2], target)
    manifest = asyncckpt.verify(f"{remote}/step_00000002")
    assert manifest["step"] == 2


def test_keep_remote_and_keep_last_are_per_tier(remote, tmp_path):
    with asyncckpt.CheckpointManager(tmp_path / "r", upload_to=remote, keep_last=1, keep_remote=2) as manager:
        for step in range(1, 5):
            manager.save(step, state(step, 0.25))
            manager.maybe_finalize(blocking=True)
        uploaded(manager)
        assert manager.steps() == [4]
        assert manager.remote_steps() == [3, 4]
    committed, unmarked = s3tier.S3Tier(remote).scan()
    assert committed == {3, 4} and not unmarked


def test_a_step_without_marker_is_absent(remote, tmp_path):
    with asyncckpt.CheckpointManager(tmp_path / "m", upload_to=remote) as manager:
        manager.save(7, state(7, 0.25))
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
    tier = s3tier.S3Tier(remote)
    tier.client.delete_object(Bucket=tier.bucket, Key=f"{s3tier.parse_url(remote).prefix}/step_00000007/.manifest.json")
    assert tier.steps() == [] and tier.scan()[1] == {7}
    with pytest.raises(asyncckpt.CheckpointNotFoundError):
        asyncckpt.read_state_dict(f"{remote}/step_00000007")
    with pytest.raises(asyncckpt.CheckpointNotFoundError):
        asyncckpt.load(zeroed(state(7, 0.25)), f"{remote}/step_00000007")
    # A manager opening the root uploads the step again (resume); the marker comes back.
    with asyncckpt.CheckpointManager(tmp_path / "m", upload_to=remote) as manager:
        uploaded(manager)
        assert manager.remote_steps() == [7]


@pytest.mark.parametrize("tier", ["local", "s3"])
def test_step_index_of_both_tiers(remote, tmp_path, tier):
    from asyncckpt.io.storage import LocalStepIndex, StepIndex

    with asyncckpt.CheckpointManager(tmp_path / "ix", upload_to=remote) as manager:
        manager.save(20, state(20, 0.1))
        manager.maybe_finalize(blocking=True)
        target = zeroed(state(20, 0.1))
        manager.load(target, 20)
        for step in (11, 12):  # saved after 20: newer saves, smaller steps
            manager.save(step, state(step, 0.1))
            manager.maybe_finalize(blocking=True)
        uploaded(manager)
    index: StepIndex = LocalStepIndex(tmp_path / "ix") if tier == "local" else s3tier.S3Tier(remote)
    assert index.steps() == [11, 12, 20]
    assert index.commit_order() == [20, 11, 12]
    assert index.read_latest() == 12
    index.remove_step(11)
    assert index.steps() == [12, 20]
    index.write_latest(20)
    assert index.read_latest() == 20
    index.remove_step(11)  # absent: no error


# ----------------------------------------------------------------------------- failures
def test_wrong_credentials_warn_once_per_step_and_training_goes_on(remote, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    outcomes = Outcomes()
    manager = asyncckpt.CheckpointManager(tmp_path / "w", upload_to=remote, callback=outcomes)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in (1, 2):
                manager.save(step, state(step, 0.25))
            assert manager.maybe_finalize(blocking=True) == [1, 2]
            uploaded(manager)
            manager.maybe_finalize()
            manager.maybe_finalize()
        messages = [str(w.message) for w in caught if issubclass(w.category, asyncckpt.UploadWarning)]
        assert len(messages) == 2 and all("SignatureDoesNotMatch" in m for m in messages), messages
        assert all("check the credentials" in m for m in messages)
        errors = outcomes.of(asyncckpt.UploadError)
        assert sorted(e.step for e in errors) == [1, 2]
        assert manager.steps() == [1, 2]
        asyncckpt.verify(manager.step_dir(2))
    finally:
        manager.close()


def test_server_down_fails_each_step_once_and_training_goes_on(remote, tmp_path, monkeypatch):
    from s3_server import _free_ports

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_ports(1)[0]}")  # nothing listens
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # the AWS SDKs' variable, honoured: one retry, not three
    outcomes = Outcomes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with asyncckpt.CheckpointManager(tmp_path / "down", upload_to=remote, callback=outcomes) as manager:
            for step in (1, 2):
                manager.save(step, state(step, 0.25))
                manager.maybe_finalize()
            assert manager.maybe_finalize(blocking=True) == [1, 2] or manager.steps() == [1, 2]
            uploaded(manager)
    messages = [str(w.message) for w in caught if issubclass(w.category, asyncckpt.UploadWarning)]
    assert len(messages) == 2 and all("cannot be reached" in m for m in messages), messages
    assert sorted(e.step for e in outcomes.of(asyncckpt.UploadError)) == [1, 2]
    assert asyncckpt.CheckpointManager(tmp_path / "down", read_only=True).steps() == [1, 2]


def test_upload_options_are_checked_before_anything_starts(tmp_path):
    cases: list[tuple[dict[str, Any], type[Exception]]] = [
        ({"keep_remote": 2}, ValueError),  # no remote tier
        ({"upload_to": "/not/a/url"}, asyncckpt.InvalidArgumentError),
        ({"upload_to": "s3://b/p", "keep_remote": 0}, asyncckpt.InvalidArgumentError),
        ({"upload_to": "s3://b/p", "upload_failure": "ignore"}, asyncckpt.InvalidArgumentError),
        ({"upload_to": "s3://b/p", "upload_timeout_s": 0}, asyncckpt.InvalidArgumentError),
        ({"upload_to": "s3://b/p", "read_only": True, "keep_remote": 3}, ValueError),
    ]
    for kwargs, error in cases:
        with pytest.raises(error):
            asyncckpt.CheckpointManager(tmp_path / "opts", **kwargs)
    assert not (tmp_path / "opts").exists() or not any((tmp_path / "opts").iterdir())


def test_upload_to_without_the_s3_extra_is_refused_at_once(remote, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "boto3", None)  # as if the `s3` extra were not installed
    with pytest.raises(asyncckpt.RemoteStorageError, match=r"pip install 'asyncckpt\[s3\]'"):
        asyncckpt.CheckpointManager(tmp_path / "x", upload_to=remote)
    with pytest.raises(asyncckpt.RemoteStorageError, match="boto3"):
        asyncckpt.read_state_dict(f"{remote}/step_00000001")
    with asyncckpt.CheckpointManager(tmp_path / "x") as manager:  # the root's lock was released
        manager.save(1, state(1, 0.1))


def test_missing_bucket_raises_with_upload_failure_raise(s3_server, remote, tmp_path):
    url = "s3://no-such-bucket-" + s3_server.access_key[-8:] + "/p"
    manager = asyncckpt.CheckpointManager(tmp_path / "nb", upload_to=url, upload_failure="raise")
    try:
        manager.save(3, state(3, 0.25))
        assert manager.maybe_finalize(blocking=True) == [3]
        uploaded(manager)
        with pytest.raises(asyncckpt.UploadError, match="NoSuchBucket") as info:
            manager.maybe_finalize()
        assert info.value.step == 3
        manager.maybe_finalize()  # reported once
        assert manager.steps() == [3]
    finally:
        manager.close()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ASYNCCKPT_LONG") != "1", reason="set ASYNCCKPT_LONG=1 (restarts the server: ~30 s)")
def test_server_killed_mid_upload_then_resumed(s3_server, remote, tmp_path, monkeypatch):
    reached = tmp_path / "reached"
    monkeypatch.setenv("ASYNCCKPT_FAULT", f"upload:touch={reached};upload:sleep=1")
    root = tmp_path / "k"
    outcomes = Outcomes()
    try:
        with asyncckpt.CheckpointManager(root, upload_to=remote, callback=outcomes, upload_timeout_s=60) as manager:
            manager.save(5, state(5))
            manager.maybe_finalize(blocking=True)
            deadline = time.monotonic() + 60
            while not reached.exists():  # the data objects are up; the marker is not
                assert time.monotonic() < deadline
                time.sleep(0.05)
            s3_server.kill()
            manager.save(6, state(6))  # training goes on while the server is down
            assert manager.maybe_finalize(blocking=True) == [6]
            uploaded(manager, 120)
            with pytest.warns(asyncckpt.UploadWarning):
                manager.maybe_finalize()
        assert sorted(e.step for e in outcomes.of(asyncckpt.UploadError)) == [5, 6]
    finally:
        if not s3_server.running:
            s3_server.start()
    monkeypatch.delenv("ASYNCCKPT_FAULT")
    tier = s3tier.S3Tier(remote)
    assert tier.steps() == []  # no marker: absent remotely
    with asyncckpt.CheckpointManager(root, upload_to=remote) as manager:  # the next start resumes
        uploaded(manager)
        assert manager.remote_steps() == [5, 6]
    assert_same(state(6), asyncckpt.read_state_dict(f"{remote}/step_00000006"))


def test_close_is_bounded_by_upload_timeout(remote, tmp_path, monkeypatch):
    reached = tmp_path / "reached"
    monkeypatch.setenv("ASYNCCKPT_FAULT", f"upload:touch={reached};upload:sleep=4")
    outcomes = Outcomes()
    manager = asyncckpt.CheckpointManager(tmp_path / "b", upload_to=remote, callback=outcomes, upload_timeout_s=0.2)
    for step in (1, 2):
        manager.save(step, state(step, 0.1))
    assert manager.maybe_finalize(blocking=True) == [1, 2]
    deadline = time.monotonic() + 60
    while not reached.exists():  # step 1's upload is in flight (held at the failpoint), step 2 queued
        assert time.monotonic() < deadline
        time.sleep(0.02)
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.close()
    assert time.monotonic() - start < 3.5  # not the 4 s the upload in flight still takes
    messages = [str(w.message) for w in caught if issubclass(w.category, asyncckpt.UploadWarning)]
    assert len(messages) == 2, messages  # each step named: the one in flight cancelled, the queued one dropped
    assert "step 1 " in messages[0] and "did not finish within upload_timeout_s=0.2" in messages[0], messages
    assert "step 2 " in messages[1] and "did not start within upload_timeout_s=0.2" in messages[1], messages
    assert [e.step for e in outcomes.of(asyncckpt.UploadError)] == [1, 2]
    time.sleep(4.5)  # step 1's upload leaves the failpoint, finds itself cancelled: no marker, no second outcome
    assert s3tier.S3Tier(remote).steps() == []
    assert [e.step for e in outcomes.of(asyncckpt.UploadError)] == [1, 2]
    assert not outcomes.of(asyncckpt.UploadResult)
    monkeypatch.delenv("ASYNCCKPT_FAULT")
    with asyncckpt.CheckpointManager(tmp_path / "b", upload_to=remote) as manager:  # step 2 is resumed
        uploaded(manager)
        assert manager.remote_steps() == [1, 2]


def test_corrupted_object_is_refused(remote, tmp_path, capsys):
    from asyncckpt.cli import main

    with asyncckpt.CheckpointManager(tmp_path / "c", upload_to=remote) as manager:
        manager.save(1, state(1))
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
    tier = s3tier.S3Tier(remote)
    key = f"{s3tier.parse_url(remote).prefix}/step_00000001/__0_0.distcp"
    obj = tier.client.get_object(Bucket=tier.bucket, Key=key)
    data = bytearray(obj["Body"].read())
    data[len(data) // 2] ^= 0xFF  # the same size, the same token: only the CRC-32s can tell
    tier.client.put_object(Bucket=tier.bucket, Key=key, Body=bytes(data), Metadata=obj["Metadata"])
    url = f"{remote}/step_00000001"
    with pytest.raises(asyncckpt.CorruptCheckpointError):
        asyncckpt.verify(url)
    with pytest.raises(asyncckpt.CorruptCheckpointError):
        asyncckpt.load(zeroed(state(1)), url)
    with pytest.raises(asyncckpt.CorruptCheckpointError):
        asyncckpt.read_state_dict(url)
    assert main(["verify", url]) == 1
    assert "__0_0.distcp" in capsys.readouterr().out  # FAILED names the damaged object


def many(seed: int) -> dict:
    """A state of 64 tensors of several dtypes and sizes, a nested value and a step."""
    g = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.bfloat16, torch.bfloat16)
    layers = {f"l{i}": torch.randn(1 + 997 * i, generator=g).to(dtypes[i % 3]) for i in range(64)}
    return {"model": layers, "extra": {"names": ["a", "b"], "lr": 0.5}, "step": seed}


def test_load_from_a_url_reads_into_the_targets_without_a_local_copy(remote, tmp_path, capsys):
    """``load`` (every ``verify``), ``CheckpointManager.load``, a partial load (DCP's
    path), ``read_state_dict``, ``verify`` and ``asyncckpt verify`` of a URL read the
    objects with ranged GETs straight into memory: bitwise equal, nothing new in
    ``/dev/shm``."""
    from asyncckpt.cli import main

    from helpers import observing_loads

    sd = many(3)
    with asyncckpt.CheckpointManager(tmp_path / "m", upload_to=remote) as manager:
        manager.save(3, sd)
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
    url = f"{remote}/step_00000003"
    shm_before = set(os.listdir("/dev/shm"))
    for verify in ("inline", True, False):
        target = zeroed(sd)
        with observing_loads() as seen:
            asyncckpt.load(target, url, verify=verify)
        assert seen.direct == 1, verify
        assert_same(sd, target)
    with asyncckpt.CheckpointManager(tmp_path / "fresh", upload_to=remote) as fresh:
        target = zeroed(sd)
        assert fresh.load(target) == 3
        assert_same(sd, target)
    part = {"model": {"l5": torch.zeros_like(sd["model"]["l5"])}}
    with observing_loads() as seen:
        asyncckpt.load(part, url)
    assert seen.dcp == 1 and torch.equal(part["model"]["l5"], sd["model"]["l5"])
    assert_same(sd, asyncckpt.read_state_dict(url))
    assert asyncckpt.verify(url)["step"] == 3
    assert main(["verify", url]) == 0
    assert f"OK      {url}  (3 files" in capsys.readouterr().out
    assert not {e for e in set(os.listdir("/dev/shm")) - shm_before if e.startswith("asyncckpt")}


def test_a_damaged_or_missing_object_fails_the_url_load(remote, tmp_path):
    """An object overwritten through the S3 API (same size, same save token: only the
    CRC-32s can tell; or of another save) fails ``load`` (both paths),
    ``read_state_dict`` and ``verify`` with
    ``CorruptCheckpointError`` naming it; a deleted object, or no checkpoint at the URL,
    with ``CheckpointNotFoundError``."""
    sd = many(4)
    with asyncckpt.CheckpointManager(tmp_path / "m", upload_to=remote) as manager:
        manager.save(4, sd)
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
    url = f"{remote}/step_00000004"
    tier = s3tier.S3Tier(remote)
    key = f"{s3tier.parse_url(remote).prefix}/step_00000004/__0_0.distcp"
    obj = tier.client.get_object(Bucket=tier.bucket, Key=key)
    good = obj["Body"].read()
    data = bytearray(good)
    data[len(data) - 4096] ^= 0x01
    tier.client.put_object(Bucket=tier.bucket, Key=key, Body=bytes(data), Metadata=obj["Metadata"])
    for verify in ("inline", True):
        with pytest.raises(asyncckpt.CorruptCheckpointError, match=r"__0_0\.distcp: checksum mismatch"):
            asyncckpt.load(zeroed(sd), url, verify=verify)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match=r"__0_0\.distcp: checksum mismatch"):
        asyncckpt.verify(url)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match=r"__0_0\.distcp: checksum mismatch"):
        asyncckpt.read_state_dict(url)
    last = {"model": {"l63": torch.zeros_like(sd["model"]["l63"])}}  # DCP's path: the segments it reads
    with pytest.raises(asyncckpt.CorruptCheckpointError, match=r"__0_0\.distcp: checksum mismatch"):
        asyncckpt.load(last, url)
    tier.client.put_object(Bucket=tier.bucket, Key=key, Body=good)  # the right bytes, of no save
    with pytest.raises(asyncckpt.CorruptCheckpointError, match=r"__0_0\.distcp belongs to another save"):
        asyncckpt.load(zeroed(sd), url)
    tier.client.delete_object(Bucket=tier.bucket, Key=key)
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match=r"__0_0\.distcp was removed"):
        asyncckpt.load(zeroed(sd), url)
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match="no committed checkpoint"):
        asyncckpt.load(zeroed(sd), f"{remote}/step_00000005")


def test_remote_delete_racing_a_reader(remote, tmp_path, monkeypatch):
    with asyncckpt.CheckpointManager(tmp_path / "d", upload_to=remote) as manager:
        manager.save(1, state(1))
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
    reached = tmp_path / "reading"
    monkeypatch.setenv("ASYNCCKPT_FAULT", f"s3_read:touch={reached};s3_read:sleep=2")
    tier = s3tier.S3Tier(remote)

    def remove() -> None:
        deadline = time.monotonic() + 30
        while not reached.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        tier.remove_step(1)  # retention: the marker first, then the data

    remover = threading.Thread(target=remove)
    remover.start()
    try:
        with pytest.raises(asyncckpt.CheckpointNotFoundError):
            asyncckpt.read_state_dict(f"{remote}/step_00000001")
    finally:
        remover.join(60)
    assert tier.scan() == (set(), set())


def test_cli_reads_urls(remote, tmp_path, capsys):
    from asyncckpt.cli import main

    with asyncckpt.CheckpointManager(tmp_path / "cli", upload_to=remote) as manager:
        for step in (1, 2):
            manager.save(step, state(step, 0.25))
        manager.maybe_finalize(blocking=True)
        uploaded(manager)
    capsys.readouterr()
    assert main(["ls", remote]) == 0
    out = capsys.readouterr().out
    assert "step_00000001" in out and "step_00000002" in out and "<- latest" in out
    url = f"{remote}/step_00000002"
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert "model.w" in out and url in out
    assert main(["verify", url]) == 0
    assert f"OK      {url}" in capsys.readouterr().out
    out_file = tmp_path / "out.pt"
    assert main(["convert", url, str(out_file), "--allow-pickle"]) == 0
    assert_same(state(2, 0.25), torch.load(out_file, weights_only=False))
    assert main(["verify", remote]) == 0  # a root: its committed steps
    out = capsys.readouterr().out
    assert f"OK      {remote}/step_00000001" in out and f"OK      {remote}/step_00000002" in out
    assert main(["verify", f"{remote}/step_00000009"]) == 1
    capsys.readouterr()

    # URLs and local paths in one call: each read through its own tier, the remote one
    # streamed (no scratch copy in memory or on disk), one JSON document for all
    assert main(["verify", "--json", url, str(tmp_path / "cli")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["checked"] == 3 and doc["failed"] == 0
    assert doc["results"][0]["path"] == url
    assert all(r["ok"] and r["files"] >= 2 for r in doc["results"])
    assert main(["verify", "--json", f"{remote}/step_00000009", str(tmp_path / "cli")]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["failed"] == 1 and "step_00000009" in doc["results"][0]["error"]


# ----------------------------------------------------------------------------- two ranks
def _two_ranks_upload(rank: int, world_size: int, root: str, url: str, env: dict[str, str], go: str) -> list:
    # The forkserver may have been started by an earlier test, before this test's server
    # variables were set: the ranks take them from the test, as a job takes its own.
    os.environ.update(env)
    if rank == 0:  # the coordinator is held before it writes the lease, until rank 1 says go
        os.environ["ASYNCCKPT_FAULT"] = f"lease:wait={go}"
    log, lines = logging.getLogger("asyncckpt"), LogLines(logging.INFO)
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    outcomes = Outcomes()
    g = torch.Generator().manual_seed(100 + rank)
    sd: dict[str, Any] = {f"own{rank}": torch.randn(1 << 18, generator=g), "step": 1}
    with asyncckpt.CheckpointManager(root, upload_to=url, callback=outcomes, upload_timeout_s=60) as manager:
        manager.save(1, sd)
        manager.maybe_finalize(blocking=True)
        if rank == 1:  # nothing of this job goes up before its coordinator holds the prefix
            deadline = time.monotonic() + 60
            while not any("waits for its coordinator's lease" in line for line in lines.lines):
                assert time.monotonic() < deadline, lines.lines
                time.sleep(0.01)
            tier = s3tier.S3Tier(url)
            listed = tier.client.list_objects_v2(Bucket=tier.bucket, Prefix=s3tier.parse_url(url).prefix + "/")
            assert listed.get("KeyCount", 0) == 0, listed.get("Contents")
            assert not manager.wait_uploads(0)
            Path(go).touch()
        assert manager.wait_uploads(60)
    os.environ.pop("ASYNCCKPT_FAULT", None)
    log.removeHandler(lines)
    # Both ranks on fresh machines: empty roots, restored from the bucket (collective load).
    # Rank 1 cannot list the bucket (an injected fault): the coordinator's choice holds
    # for every rank (before, rank 1 found nothing and raised while rank 0 loaded).
    with asyncckpt.CheckpointManager(f"{root}-fresh", upload_to=url) as fresh:
        target: dict[str, Any] = {f"own{rank}": torch.zeros(1 << 18), "step": 0}
        if rank == 1:
            os.environ["ASYNCCKPT_FAULT"] = "s3_list:raise"
        try:
            assert fresh.load(target) == 1
        finally:
            os.environ.pop("ASYNCCKPT_FAULT", None)
        assert torch.equal(target[f"own{rank}"], sd[f"own{rank}"]) and target["step"] == 1
    return [(o.step, o.bytes) for o in outcomes.of(asyncckpt.UploadResult)] + [
        str(e) for e in outcomes.of(asyncckpt.UploadError)
    ]


def test_two_ranks_upload_their_own_files_and_the_coordinator_commits(remote, tmp_path):
    from dist_utils import preload_forkserver, run_ranks

    preload_forkserver()
    env = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
    results = run_ranks(
        _two_ranks_upload,
        2,
        str(tmp_path / "root"),
        remote,
        env,
        str(tmp_path / "go"),
        timeout=120,
        start_method="forkserver",
    )
    size = {rank: (tmp_path / "root" / "step_00000001" / f"__{rank}_0.distcp").stat().st_size for rank in (0, 1)}
    assert results[1] == [(1, size[1])]  # rank 1: its data file alone
    assert results[0][0][0] == 1 and results[0][0][1] > size[0]  # rank 0: its data file and the metadata
    got = asyncckpt.read_state_dict(f"{remote}/step_00000001")
    for rank in (0, 1):
        expected = torch.randn(1 << 18, generator=torch.Generator().manual_seed(100 + rank))
        assert torch.equal(got[f"own{rank}"], expected)
    # A load GETs (and checks) only the byte ranges its plan needs: rank 0's tensor
    # loads with rank 1's object gone; a check of every file fails.
    tier = s3tier.S3Tier(remote)
    tier.client.delete_object(Bucket=tier.bucket, Key=f"{s3tier.parse_url(remote).prefix}/step_00000001/__1_0.distcp")
    for verify in (False, "inline"):
        target: dict[str, Any] = {"own0": torch.zeros(1 << 18)}
        asyncckpt.load(target, f"{remote}/step_00000001", verify=verify)
        assert torch.equal(target["own0"], got["own0"])
    with pytest.raises(asyncckpt.CheckpointNotFoundError, match=r"__1_0\.distcp"):
        asyncckpt.verify(f"{remote}/step_00000001")


def _fsdp_upload_and_load(rank: int, world_size: int, root: str, url: str, env: dict[str, str]) -> dict[str, Any]:
    """An FSDP2 state saved, uploaded, and loaded back from its URL into fresh shards."""
    from test_sharded import _compare, _fsdp, _local, _map_tensors
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import asyncckpt.loading.dcp

    from helpers import counting_calls, observing_loads

    os.environ.update(env)
    torch.set_num_threads(1)
    model, optim = _fsdp(rank, train_steps=2)
    msd, osd = get_state_dict(model, optim)
    state: dict[str, Any] = {"model": msd, "optim": osd, "step": 2}
    snapshot = _map_tensors(state, lambda t: _local(t).detach().clone())
    with asyncckpt.CheckpointManager(root, upload_to=url, upload_timeout_s=60) as manager:
        manager.save(2, state)
        manager.maybe_finalize(blocking=True)
        assert manager.wait_uploads(60)
    # rank 1's wait ends once its own objects are up; the step is committed remotely
    # once the coordinator's ends (it writes the commit marker): the ranks meet after it.
    torch.distributed.barrier()
    got = _map_tensors(state, torch.zeros_like)
    with observing_loads() as loads, counting_calls(asyncckpt.loading.dcp, "read_metadata") as reads:
        asyncckpt.load(got, f"{url}/step_00000002")
    return {
        "cmp": _compare(snapshot, _map_tensors(got, _local)),
        "path": (loads.direct, loads.shards, loads.metadata, reads.n),
    }


def test_a_sharded_checkpoint_loads_from_the_bucket_through_its_shard_index(remote, tmp_path):
    """FSDP2 shards uploaded by two ranks load back from the ``s3://`` URL into the same
    sharding, bitwise, each rank planning from the shard index and its own chunk line
    (ranged GETs), never reading ``.metadata``."""
    from dist_utils import preload_forkserver, run_ranks

    preload_forkserver()
    env = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
    results = run_ranks(
        _fsdp_upload_and_load, 2, str(tmp_path / "root"), remote, env, timeout=120, start_method="forkserver"
    )
    listed = s3tier.S3Tier(remote).client.list_objects_v2(
        Bucket=s3tier.parse_url(remote).bucket, Prefix=s3tier.parse_url(remote).prefix + "/step_00000002/"
    )
    names = {obj["Key"].rsplit("/", 1)[1] for obj in listed.get("Contents", [])}
    assert {".shards.json", ".shards.chunks.jsonl", ".metadata"} <= names, names
    for r in results:
        assert r["cmp"]["mismatch"] == [] and r["cmp"]["tensors"] > 0, r["cmp"]
        assert r["path"] == (1, 1, 0, 0), r["path"]


# ----------------------------------------------------------------------------- README
def test_readme_object_storage_snippet(s3_server, tmp_path):
    """README's "Object storage" snippet, as written, against this server; with
    ``ASYNCCKPT_LONG=1`` also again (it resumes), then on a fresh machine (an empty local
    root restores from the bucket)."""
    import re
    import shutil
    import subprocess
    import sys

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("### Object storage\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    script = tmp_path / "snippet.py"
    script.write_text(code.group(1))
    env = dict(os.environ, **s3_server.env(), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env.pop("ASYNCCKPT_FAULT", None)

    def run() -> str:
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    out = run()
    assert "uploaded step 20 to s3://ckpts/run1/step_00000020" in out and "in the bucket: [0, 10, 20]" in out, out
    if os.environ.get("ASYNCCKPT_LONG") != "1":  # the rest: ~2 runs more (the fresh machine: see the first test)
        return
    out = run()
    assert "in the bucket: [10, 20, 30, 40, 50]" in out, out
    shutil.rmtree(tmp_path / "ckpt_s3")  # a fresh machine
    out = run()
    assert "in the bucket: [40, 50, 60, 70, 80]" in out, out


# ----------------------------------------------------------------------------- the training example
def test_train_example_uploads_and_resumes_from_the_bucket(remote, tmp_path):
    """``scripts/train.py --upload-to``: one line per uploaded checkpoint; ``--resume`` in
    an empty directory restores from the bucket (bitwise: the load tests above)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
    tiny = "--n-layer 1 --n-embd 32 --n-head 2 --block-size 16 --batch-size 8 --data-mb 0.002 --quiet".split()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def train(cwd: Path, *args: str) -> str:
        cwd.mkdir(exist_ok=True)
        proc = subprocess.run(
            [sys.executable, str(script), *tiny, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=150
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    out = train(tmp_path / "a", "--steps", "8", "--ckpt-every", "3", "--stop-at", "6", "--upload-to", remote)
    for step in (3, 6):
        assert f"checkpoint step {step} uploaded | {remote}/step_{step:08d} |" in out, out
    out = train(tmp_path / "b", "--steps", "8", "--ckpt-every", "3", "--resume", "--upload-to", remote)
    assert f"resumed from step 6 in {remote}/step_00000006" in out, out  # the empty root restored from the bucket


def test_bench_s3_runs_every_row(s3_server, tmp_path, capsys):
    """scripts/bench_s3.py end to end at a tiny size against the tests' server: every row
    is printed and none failed (the benchmark's own checks compare the loaded bytes)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    try:
        from benchmark import objstore
    finally:
        sys.path.pop(0)
    env = s3_server.env()
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        argv = ["--endpoint", env["AWS_ENDPOINT_URL"], "--bucket", s3_server.bucket, "--mib", "2", "--tensors", "8"]
        assert objstore.main([*argv, "--reps", "1", "--train-k", "4", "--train-steps", "1"]) == 0
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 9 + 3, out  # the title, upload (with its CPU row) / load rows, the training rows
    assert "failed" not in out, out
    assert "x raw; goal >= 0.9x" in out and "CPU seconds per GiB" in out
    assert "upload_to (upload process) vs local only" in out and "upload_to (in a thread) vs local only" in out
    assert "steps uploaded / skipped (behind the saves) per run: 0 / 0" in out, out  # (no save in 1 step)
