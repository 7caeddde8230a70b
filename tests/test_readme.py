"""Every python snippet of README.md runs as written.

Each snippet is saved as ``snippet.py`` in a temporary directory and run there with
``python snippet.py`` in a process group of its own (killed with all its descendants at
the end), as a new user would run it. A snippet is either run here (``RUN``) or listed
in ``EXCLUDED`` with the reason; a new one that is neither fails
:func:`test_every_snippet_is_run_or_excluded`.

The last test is the one-line error of a script without a ``__main__`` guard whose
persistent worker re-imports it (see BOOTSTRAP_PATCH.md).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest
from dist_utils import free_port
from helpers import kill_process_tree, process_group_gone

README = Path(__file__).resolve().parents[1] / "README.md"
PYTHON_FENCES = {"python", "py", "python3"}


@dataclass(frozen=True)
class Snippet:
    """One fenced code block of README.md: the heading it is under, its language, its code."""

    heading: str
    lang: str
    code: str


def readme_snippets(text: str) -> list[Snippet]:
    """The fenced code blocks of a markdown text, each with the nearest heading above it."""
    snippets: list[Snippet] = []
    heading, lang, code = "", None, []  # type: ignore[var-annotated]
    for line in text.splitlines():
        fence = re.match(r"^\s*```\s*([\w+-]*)", line)
        if lang is None:
            if fence:
                lang, code = fence.group(1).lower(), []
            elif line.startswith("#"):
                heading = line.lstrip("#").strip()
        elif fence and not fence.group(1):
            snippets.append(Snippet(heading, lang, "\n".join(code) + "\n"))
            lang = None
        else:
            code.append(line)
    assert lang is None, f"unclosed code block under {heading!r}"
    return snippets


def python_snippets() -> dict[str, Snippet]:
    """The python snippets by heading (at most one per heading, so that the heading names it)."""
    found: dict[str, Snippet] = {}
    for snippet in readme_snippets(README.read_text()):
        if snippet.lang in PYTHON_FENCES:
            assert snippet.heading not in found, f"two python snippets under {snippet.heading!r}: give one a heading"
            found[snippet.heading] = snippet
    return found


# ----------------------------------------------------------------------------- running one


def run_script(path: Path, *, env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str]:
    """Run ``python path`` in its directory; return its exit code and output (stdout + stderr).

    The script runs in a session of its own; whatever of it is still alive a few seconds
    after it exits (or when it times out) is killed.
    """
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen([sys.executable, path.name], cwd=path.parent, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{path.name} still running after {timeout} s:\n{out}")
    finally:
        if proc.poll() is None or not process_group_gone(proc.pid, 10):
            kill_process_tree(proc)
        proc.wait()
    return proc.returncode, out


def one_rank_env() -> dict[str, str]:
    """What ``torchrun --nproc-per-node 1`` would set: a process group of one, in this process."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
            "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}


# ----------------------------------------------------------------------------- what each snippet must do


def _committed_steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if (p / ".metadata").is_file())


def check_manager_loop(d: Path, outs: list[str]) -> None:
    assert "trained steps 0-299; checkpoints of steps [0, 100, 200]" in outs[0], outs[0]
    assert "trained steps 201-299; checkpoints of steps [0, 100, 200]" in outs[1], outs[1]  # resumed


def check_overlapped(d: Path, outs: list[str]) -> None:
    assert re.findall(r"^committed .*/checkpoints/step_(\d+)$", outs[0], re.M) == ["00000000", "00000100",
                                                                                  "00000200"], outs[0]
    assert _committed_steps(d / "checkpoints") == [0, 100, 200]


def check_preemption(d: Path, outs: list[str]) -> None:
    assert "starting at step 0" in outs[0] and "done" not in outs[0], outs[0]
    assert "SIGTERM: step 150 committed" in outs[0], outs[0]
    assert "starting at step 151" in outs[1] and "done; checkpoints of steps [150, 200]" in outs[1], outs[1]


def check_lightning(d: Path, outs: list[str]) -> None:
    assert "Restored all states from the checkpoint at checkpoints/last.ckpt" in outs[0], outs[0]
    assert (d / "checkpoints" / "last.ckpt" / ".metadata").is_file()
    assert (d / "checkpoints" / "epoch=5-step=96.ckpt" / ".metadata").is_file()


def check_megatron(d: Path, outs: list[str]) -> None:
    assert outs[0].split() == ["committed"] * 3, outs[0]
    assert sorted(p.name for p in d.glob("step_*.txt")) == ["step_0.txt", "step_100.txt", "step_200.txt"]


def check_fsdp(d: Path, outs: list[str]) -> None:
    assert "rank 0 of 1: loaded step 1" in outs[0], outs[0]
    assert _committed_steps(d / "checkpoints") == [1]


@dataclass(frozen=True)
class Run:
    """How to run one snippet: how many times in the same directory, with what environment
    (a fresh one per run), and what must hold afterwards."""

    check: Callable[[Path, list[str]], None]
    times: int = 1
    env: Callable[[], dict[str, str]] = field(default=dict)
    exit_codes: tuple[int, ...] = ()  # of each run (default: 0)


RUN: dict[str, Run] = {
    "`CheckpointManager` in a training loop": Run(check_manager_loop, times=2),  # the 2nd run resumes
    "Overlapped staging, completion callbacks, a warm first save": Run(check_overlapped),
    "Preemption save on SIGTERM": Run(check_preemption, times=2, exit_codes=(143, 0)),  # preempted, resumed
    "With Lightning": Run(check_lightning),
    "The Megatron-style loop with `AsyncCallsQueue`": Run(check_megatron),
    # The torchrun snippet on a process group of one, set up as torchrun would (env://).
    # Several ranks and resharding: tests/test_sharded.py and test_train.py.
    "Sharded state (FSDP2 / DTensor) and resharding": Run(check_fsdp, env=one_rank_env),
}

#: Python snippets not run here, with the reason. (The ``bash`` blocks are not python:
#: the training example's commands are run by tests/test_train.py and .ci/run, the
#: ``asyncckpt`` command's by tests/test_cli.py.)
EXCLUDED: dict[str, str] = {}


def test_every_snippet_is_run_or_excluded() -> None:
    found = set(python_snippets())
    assert not set(RUN) & set(EXCLUDED)
    assert found - set(RUN) - set(EXCLUDED) == set(), "a new README snippet: add it to RUN (or EXCLUDED, with why)"
    assert set(RUN) | set(EXCLUDED) <= found, "a snippet in RUN or EXCLUDED is no longer in README.md"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("heading", list(RUN))
def test_snippet_runs_as_written(heading: str, tmp_path: Path) -> None:
    snippet, how = python_snippets()[heading], RUN[heading]
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    outs = []
    for i in range(how.times):
        rc, out = run_script(script, env=how.env())
        assert rc == (how.exit_codes[i] if how.exit_codes else 0), f"run {i + 1} of the snippet under {heading!r} exited with {rc}:\n{out}"
        outs.append(out)
    how.check(tmp_path, outs)


# ----------------------------------------------------------------------------- a script without a guard

NO_GUARD = '''\
from asyncckpt import AsyncCallsQueue, AsyncRequest

def write_fn(path):
    open(path, "w").close()

queue = AsyncCallsQueue(persistent=True)   # the worker re-imports this script: no __main__ guard
for step in range(3):
    queue.schedule_async_request(AsyncRequest(write_fn, (f"step_{step}.txt",), []))
queue.close()
'''


@pytest.mark.timeout(90)
def test_script_without_main_guard_fails_in_one_line(tmp_path: Path) -> None:
    """The worker re-imports a script without a ``__main__`` guard, which starts a worker
    again: the error says so in one line, with the fix, instead of multiprocessing's
    bootstrapping RuntimeError from inside the worker."""
    script = tmp_path / "no_guard.py"
    script.write_text(NO_GUARD)
    rc, out = run_script(script)
    assert rc == 1, out
    lines = [line for line in out.splitlines() if "__main__" in line and "could not start" in line]
    assert len(lines) == 1, out
    assert str(script) in lines[0] and """if __name__ == "__main__":""" in lines[0], out
    assert "bootstrapping phase" not in out and "spawn_main" not in out, out  # nothing from inside the worker
    assert not list(tmp_path.glob("step_*.txt")), out  # no call ran
