"""Overlapped staging and optimizers (issue 25, item 3).

With ``overlap_staging=True`` the copy into the staging buffer runs in a thread after
``save()`` returned. Optimizers whose step bumps no version counter (fused kernels,
updates through ``.data``, parameters that are ``.data`` views of one flat buffer) used
to tear the checkpoint in silence when they stepped before ``synchronize_staging()``.
A global optimizer step pre-hook now waits for the pending copy: the checkpoint holds
the state at ``save()`` time whenever an optimizer steps.

The copy is held back by the ``stage`` failpoint (``ASYNCCKPT_FAULT=stage:sleep=S``,
hit by the staging thread before it copies), so the optimizer always steps while the
copy is still pending.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import _faults

from dist_utils import run_ranks
from helpers import assert_same, clone_state

pytestmark = pytest.mark.timeout(120)

#: Large enough to be copied by the staging thread (above saving.OVERLAP_SYNC_BYTES).
NUMEL = 1 << 20


class _DataSGD(torch.optim.Optimizer):
    """Old-style SGD: updates through ``p.data`` (no version bump on ``p``)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(1024, NUMEL // 1024), torch.nn.Linear(NUMEL // 1024, 4))


def _backward(model: torch.nn.Module) -> None:
    model(torch.randn(8, 1024)).square().mean().backward()


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=0.1, fused=True)
    if kind == "adamw_foreach":
        return torch.optim.AdamW(params, lr=0.1, foreach=True)
    if kind == "sgd_data":
        return _DataSGD(params, lr=0.1)
    raise AssertionError(kind)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's parameters and the optimizer's state tensors (the live tensors)."""
    optim = {
        f"{name}.{key}": value
        for name, p in model.named_parameters()
        for key, value in opt.state.get(p, {}).items()
        if isinstance(value, torch.Tensor)
    }
    return {"model": model.state_dict(), "optim": optim}


def _loaded(mgr: asyncckpt.CheckpointManager, step: int, like: dict[str, Any]) -> dict[str, Any]:
    out = clone_state(like)
    for t in _tensors(out):
        t.fill_(float("nan"))
    mgr.load(out, step)
    return out


def _tensors(sd: Any) -> list[torch.Tensor]:
    if isinstance(sd, torch.Tensor):
        return [sd]
    if isinstance(sd, dict):
        return [t for v in sd.values() for t in _tensors(v)]
    if isinstance(sd, (list, tuple)):
        return [t for v in sd for t in _tensors(v)]
    return []


@pytest.fixture
def slow_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The staging thread sleeps 1.5 s before it copies (the training process only)."""
    monkeypatch.setenv(_faults.ENV, "stage:sleep=1.5")


def _step_before_synchronize(rank: int, world_size: int, root: str, kind: str) -> bool:
    """(each rank; one without a process group) An overlapped save of this rank's own
    keys, an optimizer step right after it (the copy held back by the failpoint): the
    step waits for the copy; the checkpoint holds this rank's values as of ``save()``,
    and the step took effect."""
    import os

    model = _model(10 + rank)
    opt = _optimizer(kind, model.parameters())
    _backward(model)
    opt.step()  # the optimizer state exists
    _backward(model)
    os.environ[_faults.ENV] = "stage:sleep=1.5"  # the staging thread of this process
    try:
        with asyncckpt.CheckpointManager(root, overlap_staging=True) as mgr:
            state = {f"rank{rank}": _state(model, opt)}
            expected = clone_state(state)
            mgr.save(1, state)
            opt.step()  # before synchronize_staging(), while the copy is still held back
            after = clone_state(_state(model, opt))
            assert mgr.maybe_finalize(blocking=True) == [1]
            got = _loaded(mgr, 1, expected)
    finally:
        os.environ.pop(_faults.ENV, None)
    assert_same(expected, got)
    assert not torch.equal(after["model"]["0.weight"], expected[f"rank{rank}"]["model"]["0.weight"]), (
        "the step did nothing"
    )
    return True


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "world_size,kind", [(1, "adamw_fused"), (1, "adamw_foreach"), (1, "sgd_data"), (2, "adamw_fused")]
)
def test_an_optimizer_step_before_synchronize_staging_never_tears_the_checkpoint(
    tmp_path: Path, world_size: int, kind: str
) -> None:
    """AdamW(fused=True) (no version bump), foreach AdamW (bumps: used to fail the save)
    and an SGD that updates through ``.data``, in one process, and a fused AdamW on two
    gloo ranks: the step right after ``save()`` waits for the copy; the committed
    checkpoint holds every rank's values as of ``save()``, and the step took effect."""
    root = str(tmp_path / "root")
    if world_size == 1:
        assert _step_before_synchronize(0, 1, root, kind)
    else:
        assert (
            run_ranks(_step_before_synchronize, world_size, root, kind, timeout=120, start_method="forkserver")
            == [True] * world_size
        )


def test_flat_buffer_parameters_stepped_through_the_flat_parameter(tmp_path: Path, slow_copy: None) -> None:
    """Megatron/DeepSpeed style: the model's parameters are ``.data`` views of one flat
    buffer, and the optimizer steps the flat parameter (no version bump on the views)."""
    model = _model(1)
    params = list(model.parameters())
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
    offset = 0
    for p in params:
        p.data = flat.data[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    opt = torch.optim.SGD([flat], lr=0.1, foreach=True)
    flat.grad = torch.randn_like(flat)
    with asyncckpt.CheckpointManager(tmp_path / "root", overlap_staging=True) as mgr:
        state = {"model": model.state_dict()}
        expected = clone_state(state)
        mgr.save(1, state)
        opt.step()
        assert mgr.maybe_finalize(blocking=True) == [1]
        got = _loaded(mgr, 1, expected)
    assert_same(expected, got)
    assert not torch.equal(model.state_dict()["0.weight"], expected["model"]["0.weight"]), "the step did nothing"


def test_one_step_waits_for_the_copies_of_several_managers(tmp_path: Path, slow_copy: None) -> None:
    """Two managers, each with an overlapped copy pending: one fused step waits for both."""
    model = _model(2)
    opt = _optimizer("adamw_fused", model.parameters())
    _backward(model)
    opt.step()
    _backward(model)
    with (
        asyncckpt.CheckpointManager(tmp_path / "a", overlap_staging=True) as a,
        asyncckpt.CheckpointManager(tmp_path / "b", overlap_staging=True) as b,
    ):
        expected = clone_state(_state(model, opt))
        a.save(1, {"model": model.state_dict()})
        b.save(1, {"optim": _state(model, opt)["optim"]})
        opt.step()
        assert a.maybe_finalize(blocking=True) == [1] and b.maybe_finalize(blocking=True) == [1]
        got_a = _loaded(a, 1, {"model": expected["model"]})
        got_b = _loaded(b, 1, {"optim": expected["optim"]})
    assert_same(expected["model"], got_a["model"])
    assert_same(expected["optim"], got_b["optim"])


def test_a_step_on_another_thread_waits_and_nothing_deadlocks(tmp_path: Path, slow_copy: None) -> None:
    """The optimizer steps on another thread while the training thread is inside
    ``synchronize_staging()`` (holding the saver's lock, joining the copy): both finish,
    the checkpoint holds the values as of ``save()``."""
    model = _model(3)
    opt = _optimizer("adamw_fused", model.parameters())
    _backward(model)
    opt.step()
    _backward(model)
    errors: list[BaseException] = []

    def step() -> None:
        try:
            opt.step()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with asyncckpt.CheckpointManager(tmp_path / "root", overlap_staging=True) as mgr:
        state = _state(model, opt)
        expected = clone_state(state)
        mgr.save(1, state)
        stepper = threading.Thread(target=step)
        stepper.start()
        mgr.synchronize_staging()
        stepper.join(60)
        assert not stepper.is_alive(), "the optimizer step never returned"
        assert not errors, errors
        assert mgr.maybe_finalize(blocking=True) == [1]
        got = _loaded(mgr, 1, expected)
    assert_same(expected, got)


def test_maybe_finalize_polls_an_overlapped_copy_and_never_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35, item 1 (the CPU side): ``maybe_finalize()`` in the loop polls an
    overlapped copy (its thread; on a GPU its CUDA event) and returns while the copy is
    held back (failpoint ``stage:wait``); the next call after the copy is over starts
    the write, and the save commits the state as of ``save()``."""
    release = tmp_path / "release"
    monkeypatch.setenv(_faults.ENV, f"stage:wait={release}")
    state = {"w": torch.arange(NUMEL, dtype=torch.float32), "step": 1}
    expected = clone_state(state)
    with asyncckpt.CheckpointManager(tmp_path / "root", options=asyncckpt.SaveOptions(overlap_staging=True)) as mgr:
        handle = mgr.save(1, state)
        returned: list[list[int]] = []
        loop = threading.Thread(target=lambda: returned.append(mgr.maybe_finalize()), daemon=True)
        loop.start()
        loop.join(20)
        assert not loop.is_alive(), "maybe_finalize() waited for the overlapped copy"
        assert returned == [[]] and not handle.done()
        release.touch()  # the copy goes on; the loop's next calls find it over, start the write, report the commit
        deadline = time.monotonic() + 60
        committed: list[int] = []
        while not committed:
            assert time.monotonic() < deadline, "the save was never committed by maybe_finalize() calls"
            committed = mgr.maybe_finalize()
            time.sleep(0.01)
        assert committed == [1]
    got = {"w": torch.zeros(NUMEL), "step": 0}
    asyncckpt.load(got, tmp_path / "root" / "step_00000001")
    assert_same(expected, got)
