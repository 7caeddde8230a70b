"""The CUDA staging path: pinned slab, non-blocking D2H copies on a side stream.

Skipped without a CUDA device (CI has none); run on a GPU machine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt.testing import staging_buffers

from helpers import assert_same

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _cuda_state(seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "w": torch.randn(4096, 1024, device="cuda", generator=g),
        "h": torch.randn(1000, device="cuda", generator=g).half(),
        "cpu": torch.arange(10),
        "step": seed,
    }


def _reference(sd: dict) -> dict:
    return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}


def _loaded_on_cpu(path: Any) -> dict:
    """The checkpoint of a :func:`_cuda_state` at ``path``, loaded into CPU tensors."""
    out = {
        "w": torch.empty(4096, 1024),
        "h": torch.empty(1000, dtype=torch.half),
        "cpu": torch.empty(10, dtype=torch.long),
        "step": 0,
    }
    asyncckpt.load(out, path)
    return out


def test_cuda_save_copies_after_pending_compute(tmp_path):
    """The D2H copies wait for the compute stream: a tensor written by a kernel still
    running when save() is called is saved with the kernel's result."""
    sd = _cuda_state(0)
    with asyncckpt.CheckpointManager(tmp_path) as mgr:
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):
            torch.matmul(a, a[:, :1024], out=sd["w"])  # queued on the compute stream
        handle = mgr.save(1, sd)
        expected = _reference(sd)  # synchronizes: the kernel's result
        sd["w"].zero_()
        handle.wait()
        buffers = staging_buffers(mgr)
        assert buffers and all(b.pinned for b in buffers)  # D2H into page-locked memory
    assert_same(expected, _loaded_on_cpu(tmp_path / "step_00000001"))


def test_cuda_overlapped_staging(tmp_path):
    sd = _cuda_state(1)
    with asyncckpt.CheckpointManager(tmp_path, overlap_staging=True) as mgr:
        expected = _reference(sd)
        handle = mgr.save(1, sd)
        b = torch.randn(2048, 2048, device="cuda")
        for _ in range(8):
            b = b @ b.T / 2048  # the next forward/backward, overlapped with the D2H copies
        mgr.synchronize_staging()
        sd["w"].add_(1)  # optimizer.step()
        handle.wait()
    out = {
        "w": torch.empty(4096, 1024, device="cuda"),
        "h": torch.empty(1000, dtype=torch.half, device="cuda"),
        "cpu": torch.empty(10, dtype=torch.long),
        "step": 0,
    }
    asyncckpt.load(out, tmp_path / "step_00000001")
    assert_same(expected, {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in out.items()})


# The tests below were written for issue 35 (item 5) in sessions without a GPU; they
# passed on an H200 (torch 2.11.0+cu130) through scripts/gpu_check.sh.


def _views_state() -> tuple[dict, torch.Tensor]:
    """A fused QKV weight (bf16) and views of it as a state: an offset slice, a transposed
    slice and a strided one; fp8 and bf16 tensors of their own; a CPU tensor; an int."""
    g = torch.Generator(device="cuda").manual_seed(35)
    qkv = torch.randn(3 * 512, 256, device="cuda", generator=g).to(torch.bfloat16)
    sd = {
        "q": qkv[:512],  # contiguous, the start of the fused storage
        "k": qkv[512:1024],  # contiguous, at an offset into it
        "v_t": qkv[1024:].t(),  # not contiguous
        "v_even_cols": qkv[1024:, ::2],  # strided
        "fp8": torch.randn(4096, device="cuda", generator=g).to(torch.float8_e4m3fn),
        "bf16": torch.randn(333, 7, device="cuda", generator=g).to(torch.bfloat16),
        "cpu": torch.arange(10),
        "step": 35,
    }
    return sd, qkv


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_cuda_low_precision_and_views_round_trip(tmp_path, overlap):
    """bf16 and float8_e4m3fn tensors, and views of a fused QKV weight (offset,
    transposed, strided), saved from the GPU come back bit for bit, as they were at the
    save, though the fused weight changes right after staging."""
    sd, qkv = _views_state()
    expected = _reference(sd)
    with asyncckpt.CheckpointManager(tmp_path, overlap_staging=overlap) as mgr:
        handle = mgr.save(1, sd)
        mgr.synchronize_staging()
        qkv.add_(1)  # optimizer.step() on the fused weight: every view changes
        handle.wait()
    out = {k: (torch.empty(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else 0) for k, v in expected.items()}
    asyncckpt.load(out, tmp_path / "step_00000001")
    assert_same(expected, out)


def test_cuda_load_in_place_matches_torch_load(tmp_path):
    """asyncckpt.load into CUDA tensors writes into them in place (H2D; the same storages)
    and gives what torch.load(map_location='cuda') of a torch.save of the same state
    gives."""
    sd = _cuda_state(35)
    torch.save(sd, tmp_path / "ref.pt")
    with asyncckpt.CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, sd).wait()
    out: dict[str, Any] = {
        "w": torch.zeros(4096, 1024, device="cuda"),
        "h": torch.zeros(1000, dtype=torch.half, device="cuda"),
        "cpu": torch.zeros(10, dtype=torch.long),
        "step": 0,
    }
    ptrs = {k: v.data_ptr() for k, v in out.items() if isinstance(v, torch.Tensor)}
    asyncckpt.load(out, tmp_path / "root" / "step_00000001")
    ref = torch.load(tmp_path / "ref.pt", map_location="cuda", weights_only=True)
    assert {k: out[k].data_ptr() for k in ptrs} == ptrs  # in place
    assert out["w"].is_cuda and out["h"].is_cuda
    assert_same(_reference(ref), _reference(out))


def test_cuda_overlapped_save_and_maybe_finalize_never_synchronize(tmp_path):
    """Issue 35, item 1: in a loop whose device is busy, an overlapped save (steady
    state: its buffer pinned by the first) and the loop's maybe_finalize() calls make no
    synchronizing CUDA call (``torch.cuda.set_sync_debug_mode("error")`` raises at one,
    naming where); the copy is waited for at synchronize_staging() only, and the save
    holds the state as of save()."""
    sd = _cuda_state(3)
    with asyncckpt.CheckpointManager(tmp_path, overlap_staging=True, keep_last=2) as mgr:
        mgr.save(1, sd)  # the first save pins its buffer (cudaHostRegister may synchronize)
        mgr.maybe_finalize(blocking=True)
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            a = a @ a / 4096  # queued work: the device is busy when the save is issued
        torch.cuda.set_sync_debug_mode("error")
        try:
            handle = mgr.save(2, sd)
            for _ in range(5):
                mgr.maybe_finalize()  # the loop's next steps: polled, never waited for
        finally:
            torch.cuda.set_sync_debug_mode(0)
        expected = _reference(sd)
        mgr.synchronize_staging()
        sd["w"].add_(1)  # optimizer.step()
        handle.wait()
    assert_same(expected, _loaded_on_cpu(tmp_path / "step_00000002"))


def test_cuda_state_too_large_for_the_memory_guard_pins_nothing(tmp_path):
    """Issue 35, item 5: a state that the memory guard refuses (here a limit of a
    millionth of the available memory) fails the save with a clear CheckpointError
    before any staging buffer is allocated or pinned."""
    sd = _cuda_state(4)
    options = asyncckpt.SaveOptions(staging_memory_limit=1e-6)
    with asyncckpt.CheckpointManager(tmp_path, options=options) as mgr:
        with pytest.raises(asyncckpt.CheckpointError, match="memory"):
            mgr.save(1, sd)
        assert staging_buffers(mgr) == ()
    assert not (tmp_path / "step_00000001").exists()


def test_cuda_error_while_issuing_the_copy_fails_the_save_and_leaves_nothing_pinned(tmp_path, monkeypatch):
    """Issue 35, item 5: a CUDA error while a save issues its D2H copies (failpoint
    ``d2h``: raise) fails that save, reported by the training thread's next call
    (``maybe_finalize``, on every rank alike); nothing of it is committed and the next
    save commits; once the manager is closed its staging buffers are released and
    unregistered from CUDA (``StagingBuffer.release``: ``cudaHostUnregister``). (Probing
    an address with ``cudaHostUnregister`` instead leaves CUDA's last error set, which the
    next test's first kernel launch raises.)"""
    sd = _cuda_state(6)
    mgr = asyncckpt.CheckpointManager(tmp_path, keep_last=3)
    try:
        mgr.save(1, sd).wait()
        pinned = [b for b in staging_buffers(mgr) if b.pinned]
        assert pinned
        monkeypatch.setenv("ASYNCCKPT_FAULT", "d2h:raise")
        mgr.save(2, sd)
        monkeypatch.delenv("ASYNCCKPT_FAULT")
        with pytest.raises(asyncckpt.CheckpointException, match="injected I/O error at d2h"):
            mgr.maybe_finalize(blocking=True)
        mgr.save(3, sd).wait()
        assert mgr.steps() == [1, 3]
    finally:
        mgr.close()
    assert staging_buffers(mgr) == ()
    assert not any(b.pinned for b in pinned)  # unregistered (cudaHostUnregister) by close()


def test_cuda_forked_writer_children_never_touch_cuda(tmp_path):
    """Issue 35, item 3: ``persistent=False`` forks a child per save from this process,
    which has initialised CUDA; a child that touched CUDA would fail ("Cannot
    re-initialize CUDA in forked subprocess"), so three saves that commit, bitwise,
    show that it did not. A persistent worker started by fork is refused (it would
    inherit the trainer's threads' locks)."""
    assert torch.cuda.is_initialized() or torch.zeros(1, device="cuda").is_cuda
    sd = _cuda_state(5)
    with asyncckpt.CheckpointManager(tmp_path, persistent=False) as mgr:
        for step in (1, 2, 3):
            sd["w"].add_(1)
            expected = _reference(sd)
            mgr.save(step, sd).wait()
            out = {
                k: (torch.empty(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else 0)
                for k, v in expected.items()
            }
            asyncckpt.load(out, tmp_path / f"step_{step:08d}")
            assert_same(expected, out)
    with pytest.raises(asyncckpt.InvalidArgumentError):
        asyncckpt.CheckpointManager(tmp_path / "fork", start_method="fork")


@pytest.mark.parametrize("tier", ["root", "local"])
def test_cuda_synchronize_staging_and_the_optimizer_step_never_wait_on_the_host(tmp_path, tier):
    """Issue 35, item 1: with the device busy (the host ahead of it, as in any training
    loop), ``synchronize_staging()`` and the optimizer's step pre-hook do not wait on the
    host for an overlapped save's D2H copy: they order the current stream after it
    (``cudaStreamWaitEvent``), and ``maybe_finalize()`` hands the save to the writer
    once it finds the copy over. From ``save()`` through ``synchronize_staging()`` (one
    save; the next one without it: the pre-hook alone), ``optimizer.step()`` and
    ``maybe_finalize()`` the host synchronizes no device, stream or event (torch's GPU
    trace, which ``set_sync_debug_mode`` does not cover for events) and makes no
    synchronizing call (``set_sync_debug_mode("error")``); each checkpoint holds the
    parameters as of its ``save()``, which the step changed right after. ``tier``:
    the manager's saves, or its local tier's (``manager.local.save``; only its newest
    step is kept, so only that one is read back). (Last in this file: the GPU trace
    stays active in the process.)"""
    import traceback

    from torch.cuda import _gpu_trace

    waits: list[str] = []
    recording = [False]

    def note(kind: str) -> Any:
        def callback(*_: Any) -> None:
            if recording[0]:
                waits.append(f"{kind} synchronization at\n" + "".join(traceback.format_stack(limit=10)))

        return callback

    torch._C._activate_gpu_trace()
    _gpu_trace.register_callback_for_device_synchronization(note("device"))
    _gpu_trace.register_callback_for_stream_synchronization(note("stream"))
    _gpu_trace.register_callback_for_event_synchronization(note("event"))
    model = torch.nn.Linear(2048, 2048, device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 2048, device="cuda")
    expected: dict[int, dict[str, torch.Tensor]] = {}
    local = tier == "local"
    root = tmp_path / "root" if local else tmp_path
    local_tier = asyncckpt.LocalTier(dir=tmp_path / "node0", every=1, replicas=0) if local else None
    with asyncckpt.CheckpointManager(root, overlap_staging=True, keep_last=3, local=local_tier) as mgr:
        save = mgr.local.save if mgr.local is not None else mgr.save
        finalize = mgr.local.maybe_finalize if mgr.local is not None else mgr.maybe_finalize
        save(1, {"model": model.state_dict()})  # the first save pins its buffer
        finalize(blocking=True)
        # step 2: synchronize_staging() before the step; step 3: the step's pre-hook alone
        for step, synchronize in ((2, True), (3, False)):
            model(x).square().mean().backward()
            a = torch.randn(4096, 4096, device="cuda")
            for _ in range(30):
                a = a @ a / 4096  # queued work: the host is ahead of the device
            expected[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}  # in stream order
            recording[0] = True
            torch.cuda.set_sync_debug_mode("error")
            try:
                handle = save(step, {"model": model.state_dict()})
                if synchronize:
                    mgr.synchronize_staging()
                optimizer.step()  # ordered after the copy, on the device
                optimizer.zero_grad()
                for _ in range(3):
                    finalize()
            finally:
                torch.cuda.set_sync_debug_mode(0)
                recording[0] = False
            assert not waits, waits[0]
            assert handle is not None
            handle.wait()
            assert not torch.equal(expected[step]["weight"], model.weight.detach())  # the step changed it
    for step, values in expected.items():
        if local and step != 3:
            continue
        out = {"model": {k: torch.empty(v.shape, dtype=v.dtype) for k, v in values.items()}}
        asyncckpt.load(out, (tmp_path / "node0" / "rank_00000" if local else tmp_path) / f"step_{step:08d}")
        for k, v in values.items():
            assert torch.equal(out["model"][k], v.cpu()), (step, k)
