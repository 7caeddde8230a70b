"""Peak and resident memory of the benchmark's process tree, sampled by a separate process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

_SAMPLER = r"""
import os, select, sys
root, interval, me = int(sys.argv[1]), float(sys.argv[2]), os.getpid()
def tree():
    out, stack = [root], [root]
    while stack:
        p = stack.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            for k in kids:
                if k != me and k not in out:
                    out.append(k)
                    stack.append(k)
    return out
def status(pid):
    # Cheap O(1) kernel counters (no page-table walk, unlike PSS from smaps).
    out = {"RssAnon:": 0, "RssShmem:": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(None, 1)[0]
                if key in out:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out["RssAnon:"], out["RssShmem:"]
def sample():
    # Private memory of every process of the tree, plus shared memory counted once
    # (the staging buffers are mapped by the trainer and its writer process).
    anon = shmem = 0
    for p in tree():
        a, sh = status(p)
        anon += a
        shmem = max(shmem, sh)
    return anon + shmem
cur = peak = sample()
while True:
    ready, _, _ = select.select([sys.stdin], [], [], interval)
    cur = sample()
    peak = max(peak, cur)
    if ready:
        cmd = sys.stdin.readline().strip()
        if cmd in ("", "quit"):
            break
        if cmd == "reset":
            peak = cur
        sys.stdout.write(f"{cur} {peak}\n")
        sys.stdout.flush()
"""


class MemorySampler:
    """Samples the resident memory of this process and its children, recursively: the
    sum of their private memory (``RssAnon``) plus the largest shared memory
    (``RssShmem``; the staging buffers and DCP's shared-memory stager are mapped by
    the trainer and its writer, so it is counted once), every ``interval`` seconds,
    from a separate process. These are O(1) kernel counters: sampling PSS instead
    (a walk of every page table through smaps) took half a core here and slowed
    the systems under test. ``now()`` and ``peak()`` in bytes.
    """

    def __init__(self, interval: float = 0.05, enabled: bool = True) -> None:
        self.enabled = enabled
        self.proc = None
        if enabled:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SAMPLER, str(os.getpid()), str(interval)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )

    def _ask(self, cmd: str) -> tuple[int, int]:
        if self.proc is None:
            return 0, 0
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        cur, peak = self.proc.stdout.readline().split()
        return int(cur), int(peak)

    def now(self) -> int:
        return self._ask("now")[0]

    def reset(self) -> int:
        return self._ask("reset")[0]

    def peak(self) -> int:
        return self._ask("peak")[1]

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.proc.stdin.write("quit\n")  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=5)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
