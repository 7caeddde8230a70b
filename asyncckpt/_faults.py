"""Fault injection points for the reliability tests (failpoints), off unless asked for.

The environment variable ``ASYNCCKPT_FAULT`` holds ``;``-separated directives
``POINT:ACTION`` read by the process that reaches ``POINT`` (the background writer
inherits the training process's environment when it is started). Points:

- ``mid_write``: in the writer, after the first half of the first data file is written;
- ``after_write``: in the writer, after every file is written and fsynced, before the
  result is returned;
- ``commit``: in the coordinator's commit, before the directory is renamed;
- ``after_rename``: in the coordinator's commit, after the directory is renamed (the
  commit point) and its parent fsynced, before ``latest`` and retention;
- ``after_latest``: in the coordinator's work after the commit point
  (``CheckpointRoot.after_commit``), after ``latest`` is written, before retention and
  the removal of leftovers;
- ``replicate``: in the training process's finalizer thread, when a replica of the
  local tier has arrived, before it is checked and written (``asyncckpt.replication``);
- ``worker_start``: in the persistent worker, as it starts (its imports done), before
  it sets up its signals and reads its first call;
- ``child_exit``: in a forked child of ``persistent=False``, after it reported its
  outcome, before it exits (``sleep``: a child whose exit blocks);
- ``stage``: in the training process, when a save starts its staging copy;
- ``d2h``: in the training process, when a save issues its device-to-host copies of
  CUDA tensors, before the first (``raise``: a CUDA error at that point);
- ``settle``: in the training process (the thread that settles the save: the
  finalizer thread in the background), when the saver starts settling a save, before
  its temporary directory is removed and its callback runs (its handle must complete
  all the same);
- ``verify_scanned``: in ``asyncckpt verify``, after a root was listed, before its
  checkpoints are checked;
- ``upload``: in the upload process (``asyncckpt.io.s3_agent``, with the training
  process's ``ASYNCCKPT_FAULT`` at the time of the job; in the upload thread with
  ``upload_process=False``), after this rank's files of a step are uploaded, before
  the coordinator's wait for the others and its commit marker (``asyncckpt.io.s3``);
- ``lease``: in the coordinator's upload thread (``asyncckpt.upload``), after it read
  the prefix's lease and found it free, lapsed or its own, before it writes it;
- ``s3_read``: when a remote checkpoint is opened for reading (or fetched), after its
  commit marker was read;
- ``s3_list``: before each listing of a remote tier's steps (``raise``: the bucket
  cannot be listed).

Actions: ``sleep=SECONDS``, ``raise`` (``OSError(EIO)``), ``enospc``
(``OSError(ENOSPC)``), ``exit=CODE`` (``os._exit``), ``kill`` (SIGKILL to itself),
``touch=PATH`` (create ``PATH``; lets a test know the point was reached), ``wait=PATH``
(block until ``PATH`` exists, at most 60 s; lets a test act at that point).
Several actions for one point run in order: ``mid_write:touch=/tmp/x;mid_write:sleep=5``.
"""

from __future__ import annotations

import errno
import os
import signal
import time

ENV = "ASYNCCKPT_FAULT"


def hit(point: str) -> None:
    """Run the actions configured for ``point`` (no-op unless ``ASYNCCKPT_FAULT`` is set)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for directive in spec.split(";"):
        name, _, action = directive.strip().partition(":")
        if name != point:
            continue
        verb, _, arg = action.partition("=")
        if verb == "sleep":
            time.sleep(float(arg))
        elif verb == "raise":
            raise OSError(errno.EIO, f"injected I/O error at {point}")
        elif verb == "enospc":
            raise OSError(errno.ENOSPC, f"injected: No space left on device at {point}")
        elif verb == "exit":
            os._exit(int(arg or 1))
        elif verb == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif verb == "touch":
            with open(arg, "a"):
                pass
        elif verb == "wait":
            deadline = time.monotonic() + 60
            while not os.path.exists(arg) and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            raise ValueError(f"{ENV}: unknown action {action!r}")
