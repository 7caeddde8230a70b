"""The upload process of the remote tier: a rank's share of a committed step, uploaded
by a process of its own instead of a thread of the training process.

Why a process. An upload is mostly waiting on the network, but each of its requests
also runs Python: botocore builds, signs and parses every ``UploadPart``, the part
threads read and hand over their bytes. In a thread of the training process all of it
needs the training process's GIL, which the training thread needs between every
kernel it launches: with ``max_concurrency`` part threads ready to run, the training
thread waits for the GIL at every switch interval, and a loop slows down by more than
the upload's CPU time (``scripts/bench_s3.py``: the loop with uploads in a thread vs
in this process). A process of its own has a GIL of its own; the training process
keeps one thread (:mod:`asyncckpt.upload`'s) that sends a job and waits in ``select``.

The protocol (one Unix stream socket pair; every message a pickled dict behind its
8-byte length; the descriptors of a job ride on its first byte, ``SCM_RIGHTS``):

- training process -> agent: ``{"op": "tier", ...}`` first (the :class:`S3Tier`'s
  fields), then per step ``{"op": "upload", ...}`` with this rank's open files of the
  step (descriptors opened at the local commit: local retention cannot take them away),
  ``{"op": "cancel"}`` (the job in flight stops before its next part, its multipart
  uploads are aborted, no commit marker), ``{"op": "quit"}``;
- agent -> training process: one ``{"sent": bytes}`` or ``{"error": exception}`` per job.

The agent runs :meth:`S3Tier.upload_step` (the remote commit protocol of
:mod:`asyncckpt.io.s3`, unchanged) at nice :data:`~asyncckpt.io.s3.UPLOAD_NICE`, with
the ``ASYNCCKPT_FAULT`` of the training process at the time of the job (the failpoint
``upload`` is reached in the agent). It ends when asked, or when its socket reaches
end of file (the training process is gone: the job in flight is cancelled first). An
agent that dies (killed, out of memory) fails the job in flight with a
``ChildProcessError`` that says so, and the next job starts a new one.

Torch-free: the agent imports this module, :mod:`asyncckpt.io.s3` and boto3 only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncckpt import _faults

__all__ = ["UploadProcess", "main"]

_HEADER = struct.Struct("!Q")
#: The most descriptors one message carries (Linux's SCM_RIGHTS limit is 253).
MAX_FDS = 253
#: Seconds the agent's job gets to stop (abort its multipart uploads) when the agent is
#: asked to quit, or its training process is gone, before the agent exits anyway.
QUIT_GRACE_S = 1.0
#: Seconds between two looks at a job's cancel event while waiting for its outcome.
_POLL_S = 0.05


def _send(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(payload))
    if fds:
        if len(fds) > MAX_FDS:
            raise ValueError(f"{len(fds)} files in one upload job: at most {MAX_FDS}")
        socket.send_fds(sock, [header], fds)
    else:
        sock.sendall(header)
    sock.sendall(payload)


def _recv_exactly(sock: socket.socket, n: int, data: bytes = b"") -> bytes | None:
    chunks = [data]
    got = len(data)
    while got < n:
        more = sock.recv(min(n - got, 1 << 20))
        if not more:
            return None
        chunks.append(more)
        got += len(more)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[Any, list[int]] | None:
    """The next message and the descriptors that came with it; ``None`` at end of file."""
    data, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
    try:
        header = _recv_exactly(sock, _HEADER.size, data) if data else None
        payload = None if header is None else _recv_exactly(sock, _HEADER.unpack(header)[0])
        if payload is None:
            raise EOFError
        return pickle.loads(payload), list(fds)
    except EOFError:
        for fd in fds:
            os.close(fd)
        return None


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` when it survives pickling, else a ``RuntimeError`` naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception of a client library
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class UploadProcess:
    """The training process's side of one upload agent (see the module docstring):
    started on the first job (by the caller's thread, never the training thread), and
    again after it died.

    Args:
        tier: the remote tier (an :class:`asyncckpt.io.s3.S3Tier`); the agent makes
            its own from the same fields (its client from the same environment).

    Thread-safe: one job at a time (:meth:`upload_step` holds a lock); :meth:`stop`
    may be called from another thread meanwhile.
    """

    def __init__(self, tier: Any) -> None:
        self._fields = {f.name: getattr(tier, f.name) for f in dataclasses.fields(tier) if f.init}
        self._lock = threading.Lock()  # one job at a time
        self._send_lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._stopped = False

    @property
    def pid(self) -> int | None:
        """The agent's pid while it runs, else ``None``."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package_parent = str(Path(__file__).resolve().parents[2])  # the same asyncckpt as ours
        code = "import sys; sys.path.insert(0, sys.argv[1]); from asyncckpt.io.s3_agent import main; main(sys.argv[2])"
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", code, package_parent, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        _send(ours, {"op": "tier", **self._fields})
        return ours

    def _died(self, step: int) -> ChildProcessError:
        proc = self._proc
        code = None
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(5)
        how = "still running" if code is None else f"exit status {code}"
        if code is not None and code < 0:
            try:
                how = f"signal {-code} ({signal.Signals(-code).name})"
            except ValueError:
                how = f"signal {-code}"
        pid = None if proc is None else proc.pid
        return ChildProcessError(f"the upload process (pid {pid}) ended ({how}) while uploading step {step}")

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def upload_step(
        self,
        step: int,
        files: Mapping[str, int],
        manifest: Mapping[str, Any],
        *,
        rank: int,
        coordinator: bool,
        timeout: float,
        cancel: threading.Event,
    ) -> int:
        """Run :meth:`asyncckpt.io.s3.S3Tier.upload_step` in the agent, on ``files``
        (object name -> an open read-only descriptor of the local file; the caller
        keeps and closes its own), and wait for its outcome. When ``cancel`` is set
        meanwhile the agent is told to stop the job.

        Returns:
            Bytes this rank uploaded.

        Raises:
            The agent's exception, as :meth:`S3Tier.upload_step` raised it
            (``CorruptCheckpointError``, ``RemoteStorageError``, ``TimeoutError``, ...).
            ChildProcessError: the agent died during the job, or was stopped.
            OSError: the agent cannot be started.
        """
        with self._lock:
            if self._stopped:
                raise ChildProcessError(f"the upload process was stopped before step {step}")
            if self._sock is None or self._proc is None or self._proc.poll() is not None:
                self._close_socket()
                self._reap()
                sock = self._start()
            else:
                sock = self._sock
            job = {
                "op": "upload",
                "step": step,
                "names": list(files),
                "manifest": dict(manifest),
                "rank": rank,
                "coordinator": coordinator,
                "timeout": timeout,
                "fault": os.environ.get(_faults.ENV),
            }
            try:
                with self._send_lock:
                    _send(sock, job, list(files.values()))
                told = quitting = False
                while True:
                    if cancel.is_set() and not told:
                        told = True
                        with self._send_lock:
                            _send(sock, {"op": "cancel"})
                    if self._stopped and not quitting:  # stop() came while this job started the agent
                        quitting = True
                        with self._send_lock:
                            _send(sock, {"op": "quit"})
                    ready, _, _ = select.select([sock], [], [], _POLL_S)
                    if ready:
                        break
                reply = _recv(sock)
            except OSError:
                reply = None
            if reply is None:
                self._close_socket()
                raise self._died(step)
            outcome, fds = reply
            for fd in fds:
                os.close(fd)
            if "error" in outcome:
                raise outcome["error"]
            return int(outcome["sent"])

    def _reap(self) -> None:
        """Reap the previous agent before a new one starts (killed first if its socket
        ended but it still runs: never two agents, never an orphan)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def stop(self, grace_s: float = QUIT_GRACE_S) -> None:
        """Ask the agent to quit (its job in flight is cancelled: its multipart uploads
        aborted, no marker), wait up to ``grace_s`` + 0.5 seconds, then SIGKILL it; reap
        it. Later jobs raise ``ChildProcessError``. Idempotent."""
        self._stopped = True
        proc, sock = self._proc, self._sock
        if proc is not None and proc.poll() is None and sock is not None:
            try:
                with self._send_lock:
                    _send(sock, {"op": "quit"})
            except OSError:
                pass
        if proc is not None:
            try:
                proc.wait(grace_s + 0.5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._lock.acquire(timeout=grace_s + 1.0):  # the job's thread has seen the end
            try:
                if self._proc is not None and self._proc.poll() is None:  # started meanwhile
                    self._proc.kill()
                    self._proc.wait()
                self._close_socket()
                self._proc = None
            finally:
                self._lock.release()


# ---------------------------------------------------------------------- the agent


class _Job:
    def __init__(self, message: dict[str, Any], fds: list[int]) -> None:
        self.message = message
        self.fds = fds
        self.cancel = threading.Event()
        self.done = threading.Event()


def _run_job(tier: Any, job: _Job, sock: socket.socket, send_lock: threading.Lock) -> None:
    message = job.message
    fault = message.get("fault")
    if fault:
        os.environ[_faults.ENV] = fault
    else:
        os.environ.pop(_faults.ENV, None)
    try:
        files = {name: f"/proc/self/fd/{fd}" for name, fd in zip(message["names"], job.fds)}
        sent = tier.upload_step(
            message["step"],
            files,
            message["manifest"],
            rank=message["rank"],
            coordinator=message["coordinator"],
            timeout=message["timeout"],
            cancel=job.cancel,
        )
        reply: dict[str, Any] = {"sent": sent}
    except Exception as exc:  # noqa: BLE001 - the job's outcome, raised again in the training process
        reply = {"error": _picklable(exc)}
    finally:
        for fd in job.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    try:
        with send_lock:
            _send(sock, reply)
    except OSError:
        pass  # the training process is gone
    finally:
        job.done.set()


def main(fd: str | int | None = None) -> None:
    """The agent's entry point (``fd``: its end of the socket pair). Never returns."""
    from asyncckpt.io import s3 as _s3  # the agent's imports: boto3 on first use

    with contextlib.suppress(OSError, AttributeError):
        os.nice(max(0, _s3.UPLOAD_NICE - os.nice(0)))
    sock = socket.socket(fileno=int(sys.argv[-1] if fd is None else fd))
    first = _recv(sock)
    if first is None or first[0].get("op") != "tier":
        os._exit(0)
    fields = {k: v for k, v in first[0].items() if k != "op"}
    tier = _s3.S3Tier(**fields)
    jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
    send_lock = threading.Lock()
    current: list[_Job] = []

    def work() -> None:
        while (job := jobs.get()) is not None:
            _run_job(tier, job, sock, send_lock)

    worker = threading.Thread(target=work, name="asyncckpt-upload-agent", daemon=True)
    worker.start()
    while True:
        try:
            received = _recv(sock)
        except OSError:
            received = None
        op = None if received is None else received[0].get("op")
        if op == "upload":
            assert received is not None
            job = _Job(received[0], received[1])
            current[:] = [job]
            jobs.put(job)
        elif op == "cancel":
            if current:
                current[0].cancel.set()
        else:  # "quit", or end of file: the training process is gone
            deadline = time.monotonic() + QUIT_GRACE_S
            if current:
                current[0].cancel.set()
                current[0].done.wait(max(0.0, deadline - time.monotonic()))
            os._exit(0)
