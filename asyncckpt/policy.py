"""Retention and save policies as small data (Orbax's ``preservation_policy`` and
``save_decision_policy``, Lightning's ``ModelCheckpoint`` arguments, in our words).

A *preservation policy* says which committed steps of a root to keep; retention
removes the others. Policies are frozen dataclasses; :class:`AnyOf` combines them (a
step is kept if any policy keeps it). Whatever the policy, retention never removes the
newest committed save (:func:`steps_to_remove`).

=====================  =========================  ===============================
asyncckpt              Orbax                      Lightning ``ModelCheckpoint``
=====================  =========================  ===============================
``LatestN(n)``         ``LatestN``, max_to_keep   ``save_top_k`` (no monitor)
``EveryNSteps(n)``     ``EveryNSteps``,           ``every_n_train_steps`` (kept)
                       keep_period
``EveryNSeconds(s)``   ``EveryNSeconds``,         ``train_time_interval``
                       keep_time_interval
``BestN(metric, n)``   ``BestN``, best_fn /       ``monitor``, ``mode``,
                       best_mode                  ``save_top_k``
``AnyOf(...)``         ``AnyPreservationPolicy``  (one callback each)
=====================  =========================  ===============================

A *save interval* (:class:`SaveInterval`) says which steps to save: every ``steps``
steps and/or every ``seconds`` seconds; ``CheckpointManager.should_save(step)``
applies it.

Torch-free, no I/O: a policy sees only :class:`StepInfo` records, which the root reads
from the manifests it already reads for the commit order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from asyncckpt.errors import InvalidArgumentError

__all__ = [
    "StepInfo",
    "PreservationPolicy",
    "LatestN",
    "EveryNSteps",
    "EveryNSeconds",
    "BestN",
    "AnyOf",
    "steps_to_remove",
    "as_policy",
    "SaveInterval",
]


@dataclass(frozen=True)
class StepInfo:
    """What a policy knows of one committed step.

    Attributes:
        step: the step number.
        commit_seq: its commit sequence number (the order of saves; 0 when unknown).
        created_unix_s: when it was committed (seconds since the epoch, the
            coordinator's clock; 0.0 when unknown).
        metrics: the metrics saved with it (``save(..., metrics=...)``), or empty.
    """

    step: int
    commit_seq: int = 0
    created_unix_s: float = 0.0
    metrics: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class PreservationPolicy(Protocol):
    """Which committed steps to keep."""

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """The steps of ``steps`` (ordered oldest save first, newest save last) that
        this policy keeps."""
        ...


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{what} must be an int >= 1, not {value!r}")
    return value


@dataclass(frozen=True)
class LatestN:
    """Keep the ``n`` newest saves (``keep_last=n`` is its short form).

    Raises:
        InvalidArgumentError: ``n`` is not an int >= 1.
    """

    n: int

    def __post_init__(self) -> None:
        _positive_int(self.n, "LatestN(n)")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {info.step for info in steps[-self.n :]}


@dataclass(frozen=True)
class EveryNSteps:
    """Keep, for ever, every step that is a multiple of ``n`` (Orbax's ``keep_period``).

    Raises:
        InvalidArgumentError: ``n`` is not an int >= 1.
    """

    n: int

    def __post_init__(self) -> None:
        _positive_int(self.n, "EveryNSteps(n)")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {info.step for info in steps if info.step % self.n == 0}


@dataclass(frozen=True)
class EveryNSeconds:
    """Keep one save per ``seconds`` of commit time: walking the saves oldest first,
    a save is kept when at least ``seconds`` passed since the last one kept
    (Orbax's ``keep_time_interval``). A save of unknown time (``created_unix_s`` 0) is
    not kept by this policy.

    Raises:
        InvalidArgumentError: ``seconds`` is not a positive finite number.
    """

    seconds: float

    def __post_init__(self) -> None:
        value = self.seconds
        if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < math.inf):
            raise InvalidArgumentError(f"EveryNSeconds(seconds) must be a positive number, not {value!r}")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        kept: set[int] = set()
        last: float | None = None
        for info in sorted((i for i in steps if i.created_unix_s > 0), key=lambda i: i.created_unix_s):
            if last is None or info.created_unix_s - last >= self.seconds:
                kept.add(info.step)
                last = info.created_unix_s
        return kept


@dataclass(frozen=True)
class BestN:
    """Keep the ``n`` best saves by ``metric`` (``mode="min"``: the smallest value is
    best, e.g. a loss; ``"max"``: the largest, e.g. an accuracy). A step saved without
    the metric (or with a value that is not a finite number) is never best. Ties go to
    the newer save.

    Raises:
        InvalidArgumentError: ``metric`` is not a non-empty str, ``n`` not an int >= 1,
            or ``mode`` not ``"min"`` / ``"max"``.
    """

    metric: str
    n: int = 1
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise InvalidArgumentError(f"BestN(metric) must be a non-empty str, not {self.metric!r}")
        _positive_int(self.n, "BestN(n)")
        if self.mode not in ("min", "max"):
            raise InvalidArgumentError(f"BestN(mode) must be 'min' or 'max', not {self.mode!r}")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        scored = []
        for order, info in enumerate(steps):
            value = info.metrics.get(self.metric) if info.metrics else None
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue
            scored.append((value if self.mode == "min" else -value, -order, info.step))
        return {step for _, _, step in sorted(scored)[: self.n]}


@dataclass(frozen=True, init=False)
class AnyOf:
    """Keep a step if any of ``policies`` keeps it (Orbax's ``AnyPreservationPolicy``).

    Raises:
        InvalidArgumentError: no policy, or one that is not a :class:`PreservationPolicy`.
    """

    policies: tuple[PreservationPolicy, ...]

    def __init__(self, *policies: PreservationPolicy) -> None:
        if not policies:
            raise InvalidArgumentError("AnyOf() needs at least one policy")
        for policy in policies:
            if not isinstance(policy, PreservationPolicy):
                raise InvalidArgumentError(f"AnyOf() takes preservation policies, not {policy!r}")
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.keep(steps)
        return kept


def as_policy(keep_last: int | None, keep: PreservationPolicy | None) -> PreservationPolicy | None:
    """The policy of a root from its two spellings: ``keep_last=n`` (the short form of
    ``LatestN(n)``) and ``keep=`` (any policy); both: a step is kept if either keeps it.
    ``None`` (both ``None``): keep every step.

    Raises:
        InvalidArgumentError: ``keep_last`` is not an int >= 1 or ``None``, or ``keep``
            not a :class:`PreservationPolicy`.
    """
    if keep is not None and not isinstance(keep, PreservationPolicy):
        raise InvalidArgumentError(f"keep= must be a preservation policy (LatestN, BestN, ...), not {keep!r}")
    if keep_last is None:
        return keep
    latest = LatestN(_positive_int(keep_last, "keep_last"))
    return latest if keep is None else AnyOf(latest, keep)


def steps_to_remove(policy: PreservationPolicy | None, steps: Sequence[StepInfo]) -> list[int]:
    """The steps retention removes under ``policy``: those it does not keep, oldest save
    first, never the newest save (the last of ``steps``)."""
    if policy is None or len(steps) <= 1:
        return []
    kept = policy.keep(steps) | {steps[-1].step}
    return [info.step for info in steps if info.step not in kept]


@dataclass(frozen=True)
class SaveInterval:
    """Which steps to save: a step that is a multiple of ``steps``, and/or the first
    step at which ``seconds`` have passed since the last save (either makes a save).

    Time is agreed, not read per rank: at each save, the manager learns every rank's
    time per step since the previous save (one small all_gather, inside the save's own
    collective call) and schedules the next time-based save at the step where the
    slowest rank's ``seconds`` will have passed, so every rank decides the same step
    without a collective per step (:meth:`CheckpointManager.should_save`).

    Raises:
        InvalidArgumentError: neither given, ``steps`` not an int >= 1, or ``seconds``
            not a positive number.
    """

    steps: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.steps is None and self.seconds is None:
            raise InvalidArgumentError("SaveInterval needs steps= and/or seconds=")
        if self.steps is not None:
            _positive_int(self.steps, "SaveInterval(steps)")
        value = self.seconds
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < math.inf)
        ):
            raise InvalidArgumentError(f"SaveInterval(seconds) must be a positive number, not {value!r}")

    def next_timed_step(self, saved_step: int, step_seconds: Iterable[float]) -> int | None:
        """The step at which the next time-based save is due, after a save at
        ``saved_step``, given every rank's measured seconds per step (``None`` without
        ``seconds``)."""
        if self.seconds is None:
            return None
        slowest = max((s for s in step_seconds if s > 0 and math.isfinite(s)), default=0.0)
        if slowest <= 0:
            return saved_step + 1
        return saved_step + max(1, math.ceil(self.seconds / slowest))
