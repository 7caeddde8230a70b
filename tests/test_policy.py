"""Retention policies as data (asyncckpt.policy), over 100+ steps: which steps remain."""

from __future__ import annotations

import pytest

from asyncckpt import InvalidArgumentError
from asyncckpt.policy import (
    AnyOf,
    BestN,
    EveryNSeconds,
    EveryNSteps,
    LatestN,
    SaveInterval,
    StepInfo,
    as_policy,
    steps_to_remove,
)


def _run(policy, n_steps: int = 120, metric=None, seconds_per_step: float = 1.0) -> list[int]:
    """Commit steps 0..n-1 one by one, applying retention after each commit as the root
    does; the steps left at the end."""
    kept: list[StepInfo] = []
    for step in range(n_steps):
        metrics = {} if metric is None or metric(step) is None else {"loss": metric(step)}
        kept.append(
            StepInfo(step, commit_seq=step + 1, created_unix_s=1000.0 + step * seconds_per_step, metrics=metrics)
        )
        doomed = set(steps_to_remove(policy, kept))
        assert kept[-1].step not in doomed  # never the newest save
        kept = [info for info in kept if info.step not in doomed]
    return [info.step for info in kept]


def test_latest_n_keeps_the_newest_saves() -> None:
    assert _run(LatestN(3)) == [117, 118, 119]


def test_every_n_steps_keeps_multiples_for_ever_and_the_newest() -> None:
    assert _run(EveryNSteps(25)) == [0, 25, 50, 75, 100, 119]


def test_best_n_by_a_metric_min_and_max_and_steps_without_it_are_never_best() -> None:
    # loss falls to a minimum at step 60, then rises; odd steps carry no metric
    def loss(step: int) -> float | None:
        return None if step % 2 else abs(step - 60) + 0.5

    assert _run(BestN("loss", 3, "min"), metric=loss) == [58, 60, 62, 119]
    # the largest losses: step 0 (60.5), then 2 and 118 (58.5 each: a tie goes to the newer save)
    assert _run(BestN("loss", 2, "max"), metric=loss) == [0, 118, 119]
    assert _run(BestN("accuracy", 2)) == [119]  # nobody has the metric: only the newest survives


def test_every_n_seconds_keeps_one_save_per_interval() -> None:
    assert _run(EveryNSeconds(30), seconds_per_step=1.0) == [0, 30, 60, 90, 119]


def test_any_of_keeps_a_step_any_policy_keeps() -> None:
    policy = AnyOf(LatestN(2), EveryNSteps(50), BestN("loss", 1))
    assert _run(policy, metric=lambda s: float((s - 33) ** 2)) == [0, 33, 50, 100, 118, 119]
    assert as_policy(2, EveryNSteps(50)) == AnyOf(LatestN(2), EveryNSteps(50))
    assert as_policy(3, None) == LatestN(3)
    assert as_policy(None, None) is None
    assert steps_to_remove(None, [StepInfo(1), StepInfo(2)]) == []


@pytest.mark.parametrize(
    "make",
    [
        lambda: LatestN(0),
        lambda: EveryNSteps(True),
        lambda: EveryNSeconds(-1),
        lambda: EveryNSeconds(float("inf")),
        lambda: BestN("", 1),
        lambda: BestN("loss", 1, "median"),  # type: ignore[arg-type]
        lambda: AnyOf(),
        lambda: AnyOf(3),  # type: ignore[arg-type]
        lambda: as_policy(0, None),
        lambda: as_policy(None, "latest"),  # type: ignore[arg-type]
        lambda: SaveInterval(),
        lambda: SaveInterval(steps=0),
        lambda: SaveInterval(seconds=0),
    ],
)
def test_bad_policies_are_refused(make) -> None:
    with pytest.raises(InvalidArgumentError):
        make()


def test_save_interval_schedules_the_timed_save_by_the_slowest_rank() -> None:
    interval = SaveInterval(seconds=10)
    assert interval.next_timed_step(100, [0.5, 2.0]) == 105  # the slowest rank: 2 s a step
    assert interval.next_timed_step(100, [30.0]) == 101  # slower than the interval: the next step
    assert interval.next_timed_step(100, []) == 101
    assert SaveInterval(steps=10).next_timed_step(100, [1.0]) is None
