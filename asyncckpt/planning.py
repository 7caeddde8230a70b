"""Validation and DCP save planning, done collectively at ``save()`` time.

The plan is torch's own (``DefaultSavePlanner``: flattening, DTensor chunks, dedup of
replicated items); we only gather the local plans over our gloo group, so every rank
computes the same global plan and metadata, and so that an input error on any rank
is raised, with the same message, on every rank before anything is written.
"""

from __future__ import annotations

import io
import uuid
from typing import Any, Mapping, NamedTuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from .dist import SyncGroup
from .errors import CheckpointError

__all__ = ["validate_state_dict", "SavePlanResult", "plan_save"]


def _path_str(path: tuple) -> str:
    return "state_dict" + "".join(f"[{p!r}]" for p in path)


def _tensor_problem(t: torch.Tensor) -> str | None:
    if getattr(t, "is_nested", False):
        return "nested tensors cannot be saved"
    if t.layout != torch.strided:
        return f"{t.layout} tensors cannot be saved (only strided); convert with .to_dense() first"
    if t.is_quantized:
        return "quantized tensors cannot be saved; dequantize() them or save int_repr() and the scales"
    if t.device.type == "meta":
        return "meta tensors have no data and cannot be saved"
    if t.device.type not in ("cpu", "cuda"):
        return f"tensors on device {t.device} are not supported (cpu or cuda)"
    return None


def validate_state_dict(state_dict: Any, max_depth: int = 200) -> None:
    """Refuse what cannot be saved, naming the offending entry.

    Accepted: nested ``dict`` (``str`` keys) and ``list`` containers; strided CPU or
    CUDA tensors (DTensor included), of any dtype; other values that ``torch.save``
    can pickle.

    Raises:
        CheckpointError: for the first offending entry (sparse, meta, quantized or
            nested tensor; non-``str`` key; nesting deeper than ``max_depth``).
    """
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"state_dict must be a dict, not {type(state_dict).__name__}")
    stack: list[tuple[tuple, Any]] = [((), state_dict)]
    while stack:
        path, value = stack.pop()
        if len(path) > max_depth:
            raise CheckpointError(f"{_path_str(path[:5])}...: nesting deeper than {max_depth} levels")
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise CheckpointError(
                        f"{_path_str(path)}: key {k!r} is a {type(k).__name__}; keys must be str "
                        "(torch.distributed.checkpoint names entries by str paths)")
                stack.append((path + (k,), v))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                stack.append((path + (i,), v))
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") and hasattr(value, "placements") else value
            problem = _tensor_problem(local)
            if problem:
                raise CheckpointError(f"{_path_str(path)}: {problem}")
        elif isinstance(value, tuple):
            # DCP stores tuples whole (pickled); tensors inside would be pickled too.
            for i, v in enumerate(value):
                if isinstance(v, torch.Tensor):
                    problem = _tensor_problem(v)
                    if problem:
                        raise CheckpointError(f"{_path_str(path + (i,))}: {problem}")


class SavePlanResult(NamedTuple):
    """This rank's part of a global save plan.

    Attributes:
        plan: this rank's final plan (what it writes).
        data: for each write item, the tensor (detached) or the ``torch.save`` bytes.
        metadata: the global DCP metadata (``storage_data`` filled in at commit).
        token: a random token, equal on all ranks (names the temporary directory).
    """

    plan: SavePlan
    data: list[Any]
    metadata: Metadata
    token: str


def plan_save(state_dict: dict[str, Any], checkpoint_id: str, sync: SyncGroup, coordinator_rank: int,
              precheck: Any = None) -> SavePlanResult:
    """Validate, plan collectively, and resolve this rank's data.

    Args:
        state_dict: the user's state_dict.
        checkpoint_id: the final checkpoint path (recorded in the metadata).
        sync: the ranks saving together.
        coordinator_rank: the rank that commits.
        precheck: optional callable run on the coordinator before planning (e.g. the
            target must not exist); its exception fails the save on every rank.

    Raises:
        CheckpointError: on every rank, if any rank's input is invalid or the precheck
            failed; the message names the rank(s).
    """
    is_coordinator = sync.rank == coordinator_rank
    error: str | None = None
    local_plan: SavePlan | None = None
    planner = DefaultSavePlanner()
    try:
        validate_state_dict(state_dict)
        if is_coordinator and precheck is not None:
            precheck()
        storage_meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=uuid.uuid4().hex)
        planner.set_up_planner(state_dict, storage_meta=storage_meta, is_coordinator=is_coordinator)
        local_plan = planner.create_local_plan()
    except Exception as exc:  # reported on every rank below
        error = f"{type(exc).__name__}: {exc}"
    token = uuid.uuid4().hex if is_coordinator else None
    gathered = sync.all_gather_object((error, local_plan, token))
    errors = {r: e for r, (e, _, _) in enumerate(gathered) if e is not None}
    if errors:
        if len(errors) == 1 and sync.world_size == 1:
            raise CheckpointError(errors[0])
        raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in errors.items()))
    token = gathered[coordinator_rank][2]
    global_plans, metadata = planner.create_global_plan([p for _, p, _ in gathered])
    plan = planner.finish_plan(global_plans[sync.rank])
    data: list[Any] = []
    try:
        for item in plan.items:
            obj = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(obj, io.BytesIO)
                data.append(obj.getvalue())
            else:
                data.append(obj.detach())
    except Exception as exc:
        # Pickling a value failed here only: still symmetric, every rank learns it.
        error = f"state_dict entry {item.index.fqn!r} cannot be pickled: {type(exc).__name__}: {exc}"
    errors = {r: e for r, e in enumerate(sync.all_gather_object(error)) if e is not None}
    if errors:
        if sync.world_size == 1:
            raise CheckpointError(errors[0])
        raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in errors.items()))
    return SavePlanResult(plan, data, metadata, token)
