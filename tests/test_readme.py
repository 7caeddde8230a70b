"""README.md runs as written: every command and snippet, in the order written, and
(with ``ASYNCCKPT_LONG=1``) all of them again.

A new user follows the README from top to bottom in the repository root, with the
programs of the ``.venv`` that command 1 creates, and may run it all again. This test
does the same, in two passes (the second, a run of it all again in the same
directories, behind ``ASYNCCKPT_LONG=1`` for the suite's time): the blocks that share
files (:data:`GROUPS`) are one job, every other block a job of its own; each job runs
in a temporary directory of its own, pass 1 then pass 2 there, two jobs at a time (the
CI machine's 2 cores), and no two jobs may leave files of the same name (in the user's
one directory they would meet):

- ``.venv/bin/python``, ``.venv/bin/torchrun`` and ``.venv/bin/asyncckpt`` there are
  small scripts that run this interpreter (the one the tests run in, with the package
  installed), and ``scripts`` links to the repository's ``scripts``;
- a ``bash`` block runs as one bash script (``set -e``), except the parts in
  :data:`SKIPPED_COMMANDS` (the installs, the test suite, the benchmark), each with why;
- every ``scripts/train.py`` command gets :data:`TINY` (a tiny model on a tiny slice of
  the corpus) before its own arguments, and its step numbers (``--steps``,
  ``--stop-at``, ``--ckpt-every``, the defaults 600 and 100 included, and the
  ``step_00000600`` directories named after them) are divided by :data:`SCALE`, so that
  a pass takes a minute or two rather than an hour;
- a ``python`` block is saved as a file and run with ``.venv/bin/python file.py``, or
  with the command its first line names (``# .venv/bin/torchrun ... fsdp_example.py``),
  as many times as the README says (:data:`PYTHON`).

Each block is either run (:data:`PYTHON`, :data:`BASH`) or skipped as a whole with the
reason (:data:`SKIPPED_BLOCKS`); a new block that is neither fails
:func:`test_every_block_is_run_or_skipped`. Every process runs in a session of its own,
killed with all its descendants at the end.

The last test is the one-line error of a script without a ``__main__`` guard whose
persistent worker re-imports it (see BOOTSTRAP_PATCH.md).
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import kill_process_tree, process_group_gone

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CODE_FENCES = {
    "python": "python",
    "py": "python",
    "python3": "python",
    "bash": "bash",
    "sh": "bash",
    "shell": "bash",
    "console": "bash",
}

# A tiny model on ~2 KB of text, for every scripts/train.py command (before its own arguments).
TINY = [
    "--n-layer",
    "1",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--block-size",
    "16",
    "--batch-size",
    "8",
    "--data-mb",
    "0.002",
    "--quiet",
]
SCALE = 25  # step numbers of the training example, divided: 600 -> 24, 300 -> 12, 100 -> 4
TRAIN_DEFAULTS = {"--steps": 600, "--ckpt-every": 100}  # train.py's defaults, scaled too


@dataclass(frozen=True)
class Block:
    """One fenced code block of README.md: the heading it is under, its language, its code."""

    heading: str
    lang: str
    code: str

    @property
    def key(self) -> tuple[str, str]:
        return self.heading, self.lang


def readme_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a markdown text, in order, each with the nearest heading
    above it; the language is normalised (``python``, ``bash``) or kept as written."""
    blocks: list[Block] = []
    heading, lang, code = "", None, []  # type: ignore[var-annotated]
    for line in text.splitlines():
        fence = re.match(r"^\s*```\s*([\w+-]*)", line)
        if lang is None:
            if fence:
                lang, code = fence.group(1).lower(), []
            elif line.startswith("#"):
                heading = line.lstrip("#").strip()
        elif fence and not fence.group(1):
            blocks.append(Block(heading, CODE_FENCES.get(lang, lang), "\n".join(code) + "\n"))
            lang = None
        else:
            code.append(line)
    assert lang is None, f"unclosed code block under {heading!r}"
    return blocks


def code_blocks() -> list[Block]:
    """The python and bash blocks, in order; at most one of each language per heading."""
    blocks = [b for b in readme_blocks(README.read_text()) if b.lang in ("python", "bash")]
    keys = [b.key for b in blocks]
    assert len(keys) == len(set(keys)), f"two blocks of one language under one heading: {keys}"
    return blocks


# ----------------------------------------------------------------------------- the user's directory


def make_workdir(d: Path) -> None:
    """``d`` as a user's checkout after command 1's install: ``.venv/bin`` and ``scripts``."""
    bin_dir = d / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, args in {"python": "", "torchrun": "-m torch.distributed.run", "asyncckpt": "-m asyncckpt"}.items():
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {args} "$@"\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    (d / "scripts").symlink_to(REPO / "scripts")


def run_in(d: Path, cmd: list[str], timeout: float) -> tuple[int, str]:
    """Run ``cmd`` in ``d`` in a session of its own; its exit code and output (stdout + stderr).

    Whatever of it is still alive a few seconds after it exits (or when it times out) is killed.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd, cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} still running after {timeout} s:\n{out}")
    finally:
        if proc.poll() is None or not process_group_gone(proc.pid, 10):
            kill_process_tree(proc)
        proc.wait()
    return proc.returncode, out


# ----------------------------------------------------------------------------- bash blocks

#: Parts of commands (between ``&&``) not run here, matched at their start, with why.
SKIPPED_COMMANDS: dict[str, str] = {
    "python3 -m venv": "the test runs in the interpreter the suite runs in, with the package installed",
    ".venv/bin/pip": "installs: .ci/run runs command 1's and command 2's",
    ".venv/bin/python -m pip": "installs: .ci/run runs command 1's and command 2's",
    ".venv/bin/python -m pytest": "the test suite itself: .ci/run runs command 2",
    ".venv/bin/python scripts/bench.py": "22-30 min; tests/test_bench.py runs the benchmark's quick mode",
}


def _scale_train_args(args: str) -> str:
    """``scripts/train.py``'s arguments with TINY first and its step numbers divided by SCALE."""
    defaults = " ".join(f"{k} {v // SCALE}" for k, v in TRAIN_DEFAULTS.items())
    scaled = re.sub(
        r"(--steps|--stop-at|--ckpt-every)(\s+|=)(\d+)",
        lambda m: f"{m.group(1)}{m.group(2)}{int(m.group(3)) // SCALE}",
        args,
    )
    return f"{shlex.join(TINY)} {defaults} {scaled}"


def as_run_here(code: str) -> str:
    """A bash block as this test runs it (see the module docstring)."""
    lines = []
    for line in code.splitlines():
        kept = [
            part
            for part in line.split(" && ")
            if not any(part.strip().startswith(prefix) for prefix in SKIPPED_COMMANDS)
        ]
        line = " && ".join(kept)
        line = re.sub(r"(scripts/train\.py)([^#]*)", lambda m: f"{m.group(1)} {_scale_train_args(m.group(2))} ", line)
        line = re.sub(r"step_(\d{8})", lambda m: f"step_{int(m.group(1)) // SCALE:08d}", line)
        lines.append(line)
    return "set -euo pipefail\n" + "\n".join(lines) + "\n"


def _committed_steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if (p / ".metadata").is_file())


def check_setup(d: Path, out: str, pass_no: int) -> None:
    # command 1's training run (--fresh: the same on both passes); command 2 is skipped
    assert re.search(r"^summary: 24 steps in", out, re.M), out
    assert "kept [16, 20, 24] in ./checkpoints" in out, out


def check_cli(d: Path, out: str, pass_no: int) -> None:
    assert re.search(r"step_00000024", out) and "latest" in out, out
    assert (d / "model.pt").is_file(), out


def check_ddp(d: Path, out: str, pass_no: int) -> None:
    assert "world size 2 | DDP" in out and "resumed from step 12 in ckpt_ddp/step_00000012" in out, out
    assert _committed_steps(d / "ckpt_ddp")[-1] == 24, out


def check_fsdp_train(d: Path, out: str, pass_no: int) -> None:
    assert "resumed from step 12 in ckpt_fsdp/step_00000012" in out, out
    assert "saved by 2 ranks, resharded to 3" in out, out


def check_training_example(d: Path, out: str, pass_no: int) -> None:
    assert "resumed from step 12 in ckpt_resume/step_00000012" in out, out
    assert "temporal checkpoint writer" in out and "kept [16, 20, 24] in ckpt_temporal" in out, out


#: bash blocks run here, by heading, with what must hold after each pass.
BASH: dict[str, Callable[[Path, str, int], None]] = {
    "Set up and run": check_setup,
    "The `asyncckpt` command": check_cli,
    "Multiple ranks": check_ddp,
    "Sharded state (FSDP2 / DTensor) and resharding": check_fsdp_train,
    "The training example": check_training_example,
}

#: Bash blocks that start over (``--fresh``, in directories of their own) do the same on
#: both passes: they run on the first only (the suite's time; test_train.py covers
#: ``--fresh`` over existing checkpoints).
BASH_PASSES: dict[str, tuple[int, ...]] = {
    # --fresh runs and the command-line tool over them: the same on both passes
    "Set up and run": (1,),
    "The `asyncckpt` command": (1,),
    "Multiple ranks": (1,),
    "Sharded state (FSDP2 / DTensor) and resharding": (1,),
    "The training example": (1,),
}

#: Blocks not run here at all, by (heading, language), with why.
SKIPPED_BLOCKS: dict[tuple[str, str], str] = {
    ("Installing for CPU or for CUDA", "bash"): "installs torch from a CUDA index (network, a GPU)",
    ("Measured results", "bash"): "the install of the bench extra and the benchmark (see SKIPPED_COMMANDS)",
    ("Object storage", "bash"): "starts an S3 server: tests/test_s3.py runs the snippet against its own SeaweedFS",
    ("Object storage", "python"): "needs an S3 server: tests/test_s3.py::test_readme_object_storage_snippet runs it",
    ("Fast recovery: the local tier", "python"): (
        "tests/test_local_tier_torchrun.py::test_node_replaced_restores_from_peers_bitwise runs it as written "
        "(--save-final added; checked bitwise against an uninterrupted run), once for both"
    ),
}


# ----------------------------------------------------------------------------- python blocks


def check_manager_loop(d: Path, outs: list[str], pass_no: int) -> None:
    assert "trained steps 0-299; checkpoints of steps [0, 100, 200]" in outs[0], outs[0]
    assert "trained steps 201-299; checkpoints of steps [0, 100, 200]" in outs[1], outs[1]


def check_policies(d: Path, outs: list[str], pass_no: int) -> None:
    # steps 0..119 saved every 10; kept: the newest two, the best, every 100th
    m = re.search(r"kept steps \[([0-9, ]+)\]; best val_loss at step (\d+)", outs[0])
    assert m, outs[0]
    kept = [int(s) for s in m.group(1).split(", ")]
    last = 110 if pass_no == 1 else 230  # run again, it goes on after its newest step
    hundreds = list(range(0, last + 1, 100))  # EveryNSteps(100): kept for ever
    best = int(m.group(2))
    assert sorted({*hundreds, best, last - 10, last}) == kept, outs[0]


def check_overlapped(d: Path, outs: list[str], pass_no: int) -> None:
    expected = [0, 100, 200] if pass_no == 1 else [300, 400, 500]  # pass 2: resumed at 201, to 500
    committed = [int(s) for s in re.findall(r"^committed .*/ckpt_overlap/step_(\d+)$", outs[0], re.M)]
    assert committed == expected, outs[0]
    assert _committed_steps(d / "ckpt_overlap") == [0, 100, 200] + ([300, 400, 500] if pass_no == 2 else [])


def check_preemption(d: Path, outs: list[str], pass_no: int) -> None:
    if pass_no == 1:
        assert "starting at step 0" in outs[0] and "done" not in outs[0], outs[0]
        assert "SIGTERM: step 150 committed" in outs[0], outs[0]
        assert "starting at step 151" in outs[1], outs[1]
        assert "done; checkpoints of steps [150, 200]" in outs[1], outs[1]
    else:  # run again: it starts after the last checkpoint, is not "preempted" and finishes
        assert "starting at step 201" in outs[0] and "done; checkpoints of steps [150, 200]" in outs[0], outs[0]


def check_lightning(d: Path, outs: list[str], pass_no: int) -> None:
    assert "Restored all states from the checkpoint at ckpt_lightning/last.ckpt" in outs[0], outs[0]
    assert (d / "ckpt_lightning" / "last.ckpt" / ".metadata").is_file()
    assert (d / "ckpt_lightning" / "epoch=5-step=96.ckpt" / ".metadata").is_file()


def check_megatron(d: Path, outs: list[str], pass_no: int) -> None:
    assert outs[0].split() == ["committed"] * 3, outs[0]
    assert sorted(p.name for p in (d / "queue_out").glob("step_*.txt")) == [
        "step_0.txt",
        "step_100.txt",
        "step_200.txt",
    ]


def check_fsdp(d: Path, outs: list[str], pass_no: int) -> None:
    for rank in range(2):  # run again, it saves the next step
        assert f"rank {rank} of 2: loaded step {pass_no}" in outs[0], outs[0]
    assert _committed_steps(d / "ckpt_sharded") == list(range(1, pass_no + 1))


def check_export(d: Path, outs: list[str], pass_no: int) -> None:
    assert "loaded ['0.bias', '0.weight', '2.bias', '2.weight']" in outs[0], outs[0]
    assert outs[0].startswith("['model.safetensors'] {") and "'0.weight': (64, 16)" in outs[0], outs[0]
    assert (d / "hf_model" / "model.safetensors").is_file()


@dataclass(frozen=True)
class Python:
    """How to run one python block: how many times per pass (the same file, the same
    directory), the exit code of each run on each pass, and what must hold afterwards."""

    check: Callable[[Path, list[str], int], None]
    times: int = 1  # per pass, unless exit_codes names fewer runs for a pass
    exit_codes: Callable[[int], tuple[int, ...]] = lambda pass_no: ()  # default: 0 each time
    passes: tuple[int, ...] = (1, 2)  # the passes that run it


PYTHON: dict[str, Python] = {
    # The 2nd run resumes at step 201 and saves nothing: every later run starts from the
    # same files and does the same, so a 2nd pass would repeat it twice more: once.
    "`CheckpointManager` in a training loop": Python(check_manager_loop, times=2, passes=(1,)),
    "Retention and save policies": Python(check_policies),
    "Overlapped staging, completion callbacks, a warm first save": Python(check_overlapped),
    # "Run this twice": preempted, then resumed; on the second pass, resumed (at step 201,
    # it saves nothing: a second run there would start from the same files and do the same).
    "Preemption save on SIGTERM": Python(
        check_preemption, times=2, exit_codes=lambda pass_no: (143, 0) if pass_no == 1 else (0,)
    ),
    # These three end the same on both passes (their checks do not depend on the pass):
    # once, for the suite's time.
    "With Lightning": Python(check_lightning, passes=(1,)),
    "The Megatron-style loop with `AsyncCallsQueue`": Python(check_megatron, passes=(1,)),
    "Sharded state (FSDP2 / DTensor) and resharding": Python(check_fsdp),  # torchrun, as its first line says
    "Export to Hugging Face": Python(check_export, passes=(1,)),
}


def python_command(block: Block) -> tuple[str, list[str]]:
    """(file name, command) for a python block: its first line's ``# .venv/bin/... FILE.py``
    command, else ``.venv/bin/python`` on a file named after its heading."""
    first = block.code.splitlines()[0]
    m = re.match(r"^#\s*(\.venv/bin/\S+.*\s(\w+\.py))\s*$", first)
    if m:
        return m.group(2), shlex.split(m.group(1))
    name = re.sub(r"\W+", "_", block.heading).strip("_").lower()[:40] + ".py"
    return name, [".venv/bin/python", name]


# ----------------------------------------------------------------------------- the tests


def test_every_block_is_run_or_skipped() -> None:
    found = [b.key for b in code_blocks()]
    handled = {(h, "python") for h in PYTHON} | {(h, "bash") for h in BASH} | set(SKIPPED_BLOCKS)
    assert not {(h, "python") for h in PYTHON} & set(SKIPPED_BLOCKS)
    assert not {(h, "bash") for h in BASH} & set(SKIPPED_BLOCKS)
    assert set(found) - handled == set(), (
        "a new README code block: add it to PYTHON / BASH (or SKIPPED_BLOCKS, with why)"
    )
    assert handled <= set(found), "a block in PYTHON, BASH or SKIPPED_BLOCKS is no longer in README.md"
    grouped = [key for group in GROUPS for key in group]
    assert len(grouped) == len(set(grouped)), "a block in two GROUPS"
    assert set(grouped) <= set(found) - set(SKIPPED_BLOCKS), "a block in GROUPS is not a run block of README.md"


def test_bash_blocks_use_the_venv() -> None:
    """The README's commands name the programs of the .venv command 1 creates (a bare
    ``python`` or ``torchrun`` would not find torch); ``export`` runs no program."""
    for block in code_blocks():
        if block.lang != "bash":
            continue
        for line in block.code.splitlines():
            for part in line.split("#")[0].split("&&"):
                words = part.split()
                if words and words[0] not in ("python3", "source", "export") and not words[0].startswith(".venv/bin/"):
                    pytest.fail(f"under {block.heading!r}: {line.strip()!r} does not run a .venv/bin program")


#: Blocks that work on the same files, each group run as one job, in README order, pass 1
#: then pass 2 (see :func:`test_readme_runs_in_order`): the command-line tool reads
#: the set-up run's ``checkpoints``; the export reads the FSDP example's ``ckpt_sharded``.
GROUPS: list[tuple[tuple[str, str], ...]] = [
    (("Set up and run", "bash"), ("The `asyncckpt` command", "bash")),
    (("Sharded state (FSDP2 / DTensor) and resharding", "python"), ("Export to Hugging Face", "python")),
]

#: Jobs run at once: the CI machine's 2 cores (most blocks are one process on one core).
CONCURRENT_JOBS = 2


def jobs() -> list[list[Block]]:
    """The run blocks in groups (:data:`GROUPS`; every other block alone), each group's
    blocks in README order, the groups in the order of their first block."""
    grouped: dict[tuple[str, str], list[Block]] = {}
    out: list[list[Block]] = []
    for block in code_blocks():
        if block.key in SKIPPED_BLOCKS:
            continue
        group = next((g for g in GROUPS if block.key in g), (block.key,))
        if group[0] not in grouped:
            grouped[group[0]] = []
            out.append(grouped[group[0]])
        grouped[group[0]].append(block)
    return out


def run_block(d: Path, block: Block, pass_no: int) -> None:
    """Run one code block of README.md in ``d`` on pass ``pass_no`` and check what must
    hold after it (see the module docstring)."""
    t0 = time.monotonic()
    where = f"pass {pass_no}, the {block.lang} block under {block.heading!r}"
    if block.lang == "bash":
        if pass_no not in BASH_PASSES.get(block.heading, (1, 2)):
            return
        script = as_run_here(block.code)
        rc, out = run_in(d, ["bash", "-c", script], timeout=240)
        assert rc == 0, f"{where} exited with {rc}:\n{script}\n{out}"
        BASH[block.heading](d, out, pass_no)
    else:
        how = PYTHON[block.heading]
        if pass_no not in how.passes:
            return
        name, cmd = python_command(block)
        (d / name).write_text(block.code)
        outs = []
        codes = how.exit_codes(pass_no) or (0,) * how.times
        for i in range(min(how.times, len(codes))):
            rc, out = run_in(d, cmd, timeout=120)
            expected = codes[i]
            assert rc == expected, f"{where}, run {i + 1}: exit code {rc}:\n{out}"
            outs.append(out)
        how.check(d, outs, pass_no)
    print(f"pass {pass_no}: {block.lang} block under {block.heading!r} in {time.monotonic() - t0:.1f} s")


#: The passes run: the second (all of it again, in the same directories) with ASYNCCKPT_LONG=1.
PASSES = (1, 2) if os.environ.get("ASYNCCKPT_LONG") == "1" else (1,)


def run_job(d: Path, blocks: list[Block]) -> None:
    """A group's blocks in ``d``: all of them in order, then (:data:`PASSES`) all of them again."""
    make_workdir(d)
    for pass_no in PASSES:
        for block in blocks:
            run_block(d, block, pass_no)


def user_files(d: Path) -> set[str]:
    """The names a job left in its directory (besides what :func:`make_workdir` made)."""
    return {p.name for p in d.iterdir()} - {".venv", "scripts"}


@pytest.mark.timeout(1200)
def test_readme_runs_in_order(tmp_path: Path) -> None:
    """Every command and snippet of README.md, in order, then (:data:`PASSES`, with
    ``ASYNCCKPT_LONG=1``) all of them again.

    The blocks that share files (:data:`GROUPS`) run as one job; every other block is a
    job of its own. Each job runs in a user's directory of its own, its blocks in README
    order (then again there), :data:`CONCURRENT_JOBS` jobs at a time. No two jobs may
    leave a file or directory of the same name: in the one directory of a user who runs the
    README from top to bottom, they would meet (and a block that needs another's files,
    undeclared in GROUPS, fails every time: the files are not in its directory)."""
    work = jobs()
    dirs = [tmp_path / f"job{i:02d}" for i in range(len(work))]
    failures: list[BaseException] = []
    with ThreadPoolExecutor(CONCURRENT_JOBS) as pool:
        futures = [pool.submit(run_job, d, blocks) for d, blocks in zip(dirs, work)]
        for future in futures:
            exc = future.exception()
            if exc is not None:
                failures.append(exc)
    if failures:
        raise failures[0]
    names = {d: user_files(d) for d in dirs}
    for (a, blocks_a), (b, blocks_b) in itertools.combinations(zip(dirs, work), 2):
        shared = names[a] & names[b]
        assert not shared, (
            f"{[x.heading for x in blocks_a]} and {[x.heading for x in blocks_b]} both leave {sorted(shared)}: "
            "in the user's one directory they would meet (a group in GROUPS if one needs the other's)"
        )


# ----------------------------------------------------------------------------- a script without a guard

NO_GUARD = """\
from asyncckpt import AsyncCallsQueue, AsyncRequest

def write_fn(path):
    open(path, "w").close()

queue = AsyncCallsQueue(persistent=True)   # the worker re-imports this script: no __main__ guard
for step in range(3):
    queue.schedule_async_request(AsyncRequest(write_fn, (f"step_{step}.txt",), []))
queue.close()
"""


@pytest.mark.timeout(90)
def test_script_without_main_guard_fails_in_one_line(tmp_path: Path) -> None:
    """The worker re-imports a script without a ``__main__`` guard, which starts a worker
    again: the error says so in one line, with the fix, instead of multiprocessing's
    bootstrapping RuntimeError from inside the worker."""
    script = tmp_path / "no_guard.py"
    script.write_text(NO_GUARD)
    rc, out = run_in(tmp_path, [sys.executable, script.name], timeout=60)
    assert rc == 1, out
    lines = [line for line in out.splitlines() if "__main__" in line and "could not start" in line]
    assert len(lines) == 1, out
    assert str(script) in lines[0] and """if __name__ == "__main__":""" in lines[0], out
    assert "bootstrapping phase" not in out and "spawn_main" not in out, out  # nothing from inside the worker
    assert not list(tmp_path.glob("step_*.txt")), out  # no call ran
