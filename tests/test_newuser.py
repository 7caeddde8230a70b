"""What a new user meets first (issue 24, items 3-7 and 10), through the public API.

- step numbers are checked (item 3);
- one job per root: a manager locks its root, across processes, and a SIGKILLed
  holder's lock is taken over (item 4);
- stock ``dcp.save`` directories load and verify as "not verifiable" (item 5);
- errors keep the documented base class and the builtin type (item 6);
- failure messages name the step and the checkpoint path (item 7);
- ``asyncckpt ls`` lists a Lightning dirpath's checkpoints (item 10).
"""

from __future__ import annotations

import ctypes
import errno
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncckpt
from asyncckpt import (
    AsyncckptError,
    CheckpointException,
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    PreemptionSave,
    read_state_dict,
)
from asyncckpt.errors import CheckpointPathError, InvalidArgumentError, RootInUseError, UnverifiableCheckpointError

from dist_utils import run_ranks
from helpers import assert_same, started_session

pytestmark = pytest.mark.timeout(120)

CLI = [sys.executable, "-m", "asyncckpt"]
REPO = Path(__file__).resolve().parent.parent


def state(seed: float = 1.0) -> dict[str, Any]:
    return {
        "w": torch.arange(12, dtype=torch.float32) * seed,
        "nested": {"b": torch.ones(3, dtype=torch.int64)},
        "epoch": 3,
    }


def zeros_like_state() -> dict[str, Any]:
    return {"w": torch.zeros(12), "nested": {"b": torch.zeros(3, dtype=torch.int64)}, "epoch": 0}


def cli(*args: Any, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ASYNCCKPT_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["COLUMNS"] = "200"
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


def dir_names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


# ============================================================================ item 3: steps
BAD_STEPS = [-1, 1.5, "7", True, False, None, torch.tensor(2.5), torch.tensor(True), torch.tensor([3, 4])]


@pytest.mark.parametrize("bad", BAD_STEPS, ids=repr)
def test_a_bad_step_is_refused_before_anything_is_staged(tmp_path: Path, bad: Any) -> None:
    root = tmp_path / "root"
    with CheckpointManager(root, persistent=False) as manager:
        for async_op in (True, False):
            with pytest.raises(ValueError, match="step must be a non-negative int") as info:
                manager.save(bad, state(), async_op=async_op)
            assert isinstance(info.value, AsyncckptError) and isinstance(info.value, InvalidArgumentError)
        assert dir_names(root) == [], "nothing may be staged or written for a bad step"
        assert manager.maybe_finalize(blocking=True) == []
        manager.save(1, state())
        manager.maybe_finalize(blocking=True)
        if bad is not None:  # load(step=None) is the latest
            with pytest.raises(ValueError, match="step must be a non-negative int") as info:
                manager.load(zeros_like_state(), bad)
            assert isinstance(info.value, AsyncckptError)
    assert dir_names(root) == ["step_00000001"]


def test_integer_scalars_are_steps(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    with CheckpointManager(tmp_path, persistent=False) as manager:
        manager.save(np.int64(3), state(3.0), async_op=False)
        manager.save(torch.tensor(4), state(4.0), async_op=False)  # type: ignore[arg-type]
        manager.save(np.uint8(5), state(5.0))
        assert manager.maybe_finalize(blocking=True) == [5]
        assert manager.steps() == [3, 4, 5] and manager.latest_step() == 5
        target = zeros_like_state()
        assert manager.load(target, np.int32(4)) == 4
        assert_same(state(4.0), target)
        with pytest.raises(ValueError, match=r"\(bool\)"):
            manager.save(np.bool_(True), state())


def test_save_function_step_is_checked_and_recorded(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="step must be a non-negative int, not -1"):
        asyncckpt.save(state(), tmp_path / "ck", step=-1)
    assert not (tmp_path / "ck").exists()
    asyncckpt.save(state(), tmp_path / "ck", step=7)
    assert json.loads((tmp_path / "ck" / ".manifest.json").read_text())["step"] == 7


def test_preemption_finish_and_reached_check_the_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, persistent=False) as manager:
        preemption = PreemptionSave(manager)
        try:
            for bad in ("7", -1, 2.0, True):
                with pytest.raises(InvalidArgumentError, match="step must be a non-negative int"):
                    preemption.finish(bad, state())  # type: ignore[arg-type]
                with pytest.raises(InvalidArgumentError, match="step must be a non-negative int"):
                    preemption.reached(bad)  # type: ignore[arg-type]
            assert preemption.reached(1) is False
        finally:
            preemption.close()
        assert dir_names(tmp_path) == []


# ============================================================================ item 6: error types
def test_argument_errors_at_the_api_boundary(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "root", persistent=False) as manager:
        with pytest.raises(TypeError, match=r"the call is save\(step, state_dict\)") as info:
            manager.save(state(), 3)  # type: ignore[arg-type]  # swapped
        assert isinstance(info.value, AsyncckptError) and isinstance(info.value, ValueError)
        with pytest.raises(InvalidArgumentError, match="state_dict must be a dict"):
            manager.save(3, [torch.ones(2)])  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match=r"the call is load\(state_dict, step\)"):
            manager.load(3, state())  # type: ignore[arg-type]  # swapped
    for call in (
        lambda: asyncckpt.save(tmp_path / "x", state()),  # type: ignore[arg-type]  # swapped
        lambda: asyncckpt.load(tmp_path / "x", state()),  # type: ignore[arg-type]
        lambda: asyncckpt.save(state(), 5),  # type: ignore[arg-type]
        lambda: read_state_dict(state()),  # type: ignore[arg-type]
        lambda: CheckpointManager(state()),  # type: ignore[arg-type]
        lambda: CheckpointManager(tmp_path / "k", keep_last=0),
        lambda: CheckpointManager(tmp_path / "c", coordinator_rank="0"),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidArgumentError) as info:
            call()
        assert isinstance(info.value, (TypeError, ValueError)) and isinstance(info.value, AsyncckptError)
    assert not (tmp_path / "x").exists() and not (tmp_path / "5").exists()


def test_read_state_dict_on_a_missing_path_or_a_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory") as info:
        read_state_dict(tmp_path / "nope")
    assert isinstance(info.value, CheckpointNotFoundError) and isinstance(info.value, AsyncckptError)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError) as info2:
        read_state_dict(tmp_path / "file")
    assert isinstance(info2.value, AsyncckptError) and isinstance(info2.value, CheckpointPathError)


READ_ONLY_ROOT = textwrap.dedent("""
    import errno, sys
    from pathlib import Path
    import asyncckpt
    from asyncckpt import AsyncckptError, CheckpointManager
    ro = Path(sys.argv[1])
    for root in (ro, ro / "sub"):  # the lock file / the directory cannot be created
        try:
            CheckpointManager(root, persistent=False)
        except PermissionError as exc:
            assert isinstance(exc, AsyncckptError) and exc.errno == errno.EACCES, repr(exc)
            assert str(ro) in str(exc), str(exc)
            print("refused:", type(exc).__mro__[1].__name__, exc)
        else:
            raise AssertionError(f"a manager opened the read-only root {root}")
    state = {"w": __import__("torch").zeros(12)}
    asyncckpt.load(state, ro / "step_00000001")  # reading needs no lock
    print("loaded", float(state["w"].sum()))
""")


def _drop_permission_override() -> None:
    """(preexec_fn, as root) Drop the capabilities that bypass file permissions from the
    bounding set: the exec'd process runs as root without them, so a 0555 directory is
    read-only to it."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


@pytest.mark.timeout(180)
def test_a_read_only_root_raises_a_permission_error_of_ours(tmp_path: Path) -> None:
    as_root = os.geteuid() == 0
    base = tmp_path
    try:
        ro = base / "ro"
        ro.mkdir()
        asyncckpt.save({"w": torch.arange(12, dtype=torch.float32)}, ro / "step_00000001")
        for p in (base, ro, ro / "step_00000001", *(ro / "step_00000001").iterdir()):
            p.chmod(0o755 if p.is_dir() else 0o644)
        ro.chmod(0o555)
        env = {k: v for k, v in os.environ.items() if k != "ASYNCCKPT_FAULT"}
        env["PYTHONPATH"] = str(REPO)
        env["HOME"] = str(base)
        proc = subprocess.run(
            [sys.executable, "-c", READ_ONLY_ROOT, str(ro)],
            capture_output=True,
            text=True,
            timeout=150,
            env=env,
            cwd=str(base),
            preexec_fn=_drop_permission_override if as_root else None,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count("refused: CheckpointPathError") == 2 and "loaded 66.0" in proc.stdout, proc.stdout
    finally:
        (base / "ro").chmod(0o755)


def test_a_root_that_is_a_file_raises_an_error_of_ours(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    for root in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        with pytest.raises((NotADirectoryError, FileExistsError)) as info:
            CheckpointManager(root, persistent=False)
        assert isinstance(info.value, AsyncckptError) and isinstance(info.value, CheckpointPathError)


# ============================================================================ item 4: one job per root
def test_a_second_manager_in_this_process_is_refused_until_the_first_is_closed(tmp_path: Path) -> None:
    first = CheckpointManager(tmp_path, persistent=False)
    try:
        first.save(1, state(), async_op=False)
        with pytest.raises(RootInUseError, match=f"pid {os.getpid()}") as info:
            CheckpointManager(tmp_path, persistent=False)
        assert info.value.pid == os.getpid() and info.value.host == socket.gethostname()
        assert isinstance(info.value, AsyncckptError) and str(tmp_path) in str(info.value)
        # reading needs no lock
        target = zeros_like_state()
        asyncckpt.load(target, tmp_path / "step_00000001")
        assert_same(state(), read_state_dict(tmp_path / "step_00000001"))
        ls = cli("ls", tmp_path)
        assert ls.returncode == 0 and "step_00000001" in ls.stdout, ls.stderr
    finally:
        first.close()
    with CheckpointManager(tmp_path, persistent=False) as second:  # closed: free again
        assert second.steps() == [1]
    third = CheckpointManager(tmp_path, persistent=False)
    del third  # collected without close(): released
    gc.collect()
    CheckpointManager(tmp_path, persistent=False).close()


HOLDER = textwrap.dedent("""
    import sys, time
    from asyncckpt import CheckpointManager
    manager = CheckpointManager(sys.argv[1], persistent=False)
    print("ready", flush=True)
    sys.stdin.readline()      # hold the root until told, or until killed
    manager.close()
""")


@pytest.mark.timeout(180)
def test_another_process_holds_the_root_and_a_sigkilled_holder_is_taken_over(tmp_path: Path) -> None:
    root = tmp_path / "root"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    with started_session(
        [sys.executable, "-c", HOLDER, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    ) as holder:
        assert holder.stdout.readline().strip() == "ready", holder.stderr.read()
        with pytest.raises(RootInUseError) as info:
            CheckpointManager(root, persistent=False)
        assert info.value.pid == holder.pid and info.value.host == socket.gethostname()
        assert f"process {holder.pid} on host {socket.gethostname()}" in str(info.value)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(30)
    with CheckpointManager(root, persistent=False) as manager:  # the dead holder's lock is taken over
        manager.save(2, state(2.0), async_op=False)
        assert manager.steps() == [2]
    # and the other way round: this process holds it, a second process is refused
    with CheckpointManager(root, persistent=False):
        proc = subprocess.run(
            [sys.executable, "-c", HOLDER, str(root)], input="\n", capture_output=True, text=True, timeout=120, env=env
        )
        assert proc.returncode != 0 and "RootInUseError" in proc.stderr
        assert f"process {os.getpid()} on host {socket.gethostname()}" in proc.stderr


def _rank_two_managers(rank: int, world_size: int, root: str) -> dict[str, Any]:
    manager = CheckpointManager(root, persistent=False)  # rank 1 of the same job is not refused
    try:
        manager.save(1, {"r": torch.full((2,), float(rank))}, async_op=False)
        try:
            CheckpointManager(root, persistent=False)
            second = "accepted"
        except RootInUseError as exc:  # raised on every rank, not only the lock's holder
            second = f"refused pid={exc.pid}"
        return {"second": second, "steps": manager.steps(), "pid": os.getpid()}
    finally:
        manager.close()


@pytest.mark.timeout(200)
def test_ranks_of_one_job_share_the_root_and_a_second_manager_is_refused_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_rank_two_managers, 2, str(tmp_path), timeout=150, start_method="forkserver")
    holder = results[0]["pid"]
    assert [r["second"] for r in results] == [f"refused pid={holder}"] * 2
    assert all(r["steps"] == [1] for r in results)


# ============================================================================ item 5: stock DCP
def test_a_stock_dcp_checkpoint_loads_with_one_warning_and_is_not_verifiable(tmp_path: Path) -> None:
    stock = tmp_path / "step_00000001"  # named like ours, but not in an asyncckpt root
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state(), checkpoint_id=str(stock))
    for verify in ("inline", True, False):
        target = zeros_like_state()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            asyncckpt.load(target, stock, verify=verify)
        ours = [w for w in caught if "checksum" in str(w.message)]
        assert len(ours) == 1 and ".manifest.json" in str(ours[0].message), [str(w.message) for w in caught]
        assert ours[0].filename == __file__  # points at the caller
        assert_same(state(), target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same(state(), read_state_dict(stock))
    assert any("checksums were not verified" in str(w.message) for w in caught)
    with pytest.raises(UnverifiableCheckpointError, match="no manifest: not verifiable") as info:
        asyncckpt.verify(stock)
    assert not isinstance(info.value, CorruptCheckpointError)
    proc = cli("verify", stock)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "UNVERIFIABLE" in proc.stdout and "no manifest: not verifiable" in proc.stdout
    assert "FAILED" not in proc.stdout
    doc = json.loads(cli("verify", stock, "--json").stdout)
    assert doc["unverifiable"] == 1 and doc["failed"] == 0 and not doc["ok"]
    help_text = cli("verify", "--help").stdout + cli("--help").stdout
    assert "3" in help_text and "not verifiable" in help_text.replace("\n", " ")


def test_a_checkpoint_of_a_root_that_lost_its_manifest_is_still_corrupt(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, persistent=False) as manager:
        manager.save(1, state(), async_op=False)
    (tmp_path / "step_00000001" / ".manifest.json").unlink()
    for verify in ("inline", False):
        with pytest.raises(CorruptCheckpointError, match=r"\.manifest\.json is missing"):
            asyncckpt.load(zeros_like_state(), tmp_path / "step_00000001", verify=verify)
    with pytest.raises(CorruptCheckpointError):
        asyncckpt.verify(tmp_path / "step_00000001")
    with pytest.raises(CorruptCheckpointError, match=r"\.manifest\.json is missing"):
        read_state_dict(tmp_path / "step_00000001", verify=False)
    proc = cli("verify", tmp_path / "step_00000001")
    assert proc.returncode == 1 and "FAILED" in proc.stdout, (proc.stdout, proc.stderr)
    # a stock directory beside a corrupt one: the corruption decides the exit status
    stock = tmp_path.parent / f"{tmp_path.name}-stock"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state(), checkpoint_id=str(stock))
    assert cli("verify", stock, tmp_path / "step_00000001").returncode == 1


# ============================================================================ item 7: wording
@pytest.mark.parametrize("async_op", [False, True])
def test_a_failed_save_is_named_by_its_step_and_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_op: bool
) -> None:
    with CheckpointManager(tmp_path, persistent=False) as manager:
        for step in range(1, 10):  # the queue's call numbers drift from the steps
            manager.save(step, state(float(step)))
        manager.maybe_finalize(blocking=True)
        monkeypatch.setenv("ASYNCCKPT_FAULT", "after_write:raise")
        with pytest.raises(CheckpointException) as info:
            manager.save(10, state(), async_op=async_op).wait()
        monkeypatch.delenv("ASYNCCKPT_FAULT")
        text = str(info.value)
        path = str(tmp_path / "step_00000010")
        assert text.startswith(f"saving step 10 to {path} failed on rank(s) 0:"), text
        assert "async call" not in text and "injected I/O error" in text
        assert info.value.step == 10 and info.value.checkpoint_dir == path
        if not async_op:  # written in this process: no "remote" traceback
            assert "Remote traceback" not in text
        assert manager.steps() == list(range(1, 10))


def test_the_new_errors_are_exported_and_pickle() -> None:
    import pickle

    for name in ("CheckpointPathError", "InvalidArgumentError", "RootInUseError", "UnverifiableCheckpointError"):
        assert issubclass(getattr(asyncckpt, name), AsyncckptError) and name in asyncckpt.__all__
    perm = CheckpointPathError.of(errno.EACCES, "cannot create the checkpoint root", "/r")
    for exc in (
        perm,
        RootInUseError("in use", "/r", 12, "h"),
        CheckpointException(3, {0: "x"}, 10, "/r/s"),
        UnverifiableCheckpointError("no manifest", "/c"),
    ):
        copy = pickle.loads(pickle.dumps(exc))
        assert type(copy) is type(exc) and str(copy) == str(exc)
    assert isinstance(pickle.loads(pickle.dumps(perm)), PermissionError)


def test_the_framework_api_still_names_its_calls(tmp_path: Path) -> None:
    exc = CheckpointException(4, {1: "boom"})
    assert str(exc).startswith("async call 4 failed on rank(s) 1:") and exc.call_idx == 4


# ============================================================================ item 10: Lightning in ls
@pytest.mark.timeout(240)
def test_ls_lists_the_checkpoints_of_a_lightning_dirpath(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    import lightning.pytorch as lightning
    from torch.utils.data import DataLoader, TensorDataset

    from asyncckpt.lightning import AsyncckptCheckpointIO

    class Tiny(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    dirpath = tmp_path / "ckpts"
    lightning.seed_everything(0)
    x = torch.randn(64, 4)
    trainer = lightning.Trainer(
        max_steps=16,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        logger=False,
        default_root_dir=tmp_path,
        enable_model_summary=False,
        callbacks=[lightning.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=8, save_top_k=-1)],
        plugins=[AsyncckptCheckpointIO()],
    )
    trainer.fit(Tiny(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
    names = sorted(p.name for p in dirpath.iterdir() if not p.name.startswith("."))
    assert names == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt"], names

    doc = json.loads(cli("ls", dirpath, "--json").stdout)
    listed = {c["name"]: c for c in doc["checkpoints"]}
    assert sorted(listed) == names
    for name in names:
        entry = listed[name]
        assert entry["step"] == int(name.split("step=")[1].split(".")[0])  # Lightning's global_step
        assert entry["bytes"] > 0 and entry["committed_at"] and entry["path"] == str(dirpath / name)
    proc = cli("ls", dirpath)
    assert proc.returncode == 0 and "no committed checkpoints" not in proc.stdout
    assert "epoch=1-step=16.ckpt" in proc.stdout and "epoch=0-step=8.ckpt" in proc.stdout
    assert cli("verify", dirpath).returncode == 0


def test_a_read_only_manager_takes_no_lock_and_refuses_to_save(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, persistent=False) as writer:
        writer.save(1, state(), async_op=False)
        with CheckpointManager(tmp_path, persistent=False, read_only=True) as reader:
            assert reader.steps() == [1] and reader.latest_step() == 1
            target = zeros_like_state()
            assert reader.load(target) == 1
            assert_same(state(), target)
            with pytest.raises(asyncckpt.CheckpointError, match="read-only"):
                reader.save(2, state())
        writer.save(2, state(), async_op=False)
    assert dir_names(tmp_path) == ["step_00000001", "step_00000002"]
