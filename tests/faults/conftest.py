"""Fixtures local to the fault-injection suite."""

from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture(autouse=True)
def _stop_resource_tracker() -> Iterator[None]:
    """Stop multiprocessing's interpreter-wide resource tracker after each test.

    Spawning a process (the persistent worker, ``run_ranks``) starts it; it would live
    until the interpreter exits and the top-level ``no_leaks`` check would count it.
    """
    yield
    import gc
    from multiprocessing import resource_tracker

    gc.collect()  # unlink the named semaphores of collected multiprocessing queues
    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        stop()
