"""Validation and DCP save planning, done collectively at ``save()`` time.

One module over 600 lines, on purpose: validation, the structure signature and the
plan cache's lookup are one walk of the state dict (a steady save walks it once), and
the error funnel around DCP's planner must see all three.

The plan is torch's own (``DefaultSavePlanner``: flattening, DTensor chunks, dedup of
replicated items); we only gather the local plans over our gloo group, so every rank
computes the same global plan and metadata, and so that an input error on any rank
is raised, with the same message, on every rank before anything is written.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import io
import pickle
import secrets
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, TypeGuard

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful

from asyncckpt._check import int_key
from asyncckpt.dist import SyncGroup
from asyncckpt.errors import CheckpointError, RankFailure

if TYPE_CHECKING:  # imported for the annotations only: planning never imports DTensor
    from torch.distributed.tensor import DTensor

__all__ = ["validate_state_dict", "structure_signature", "SavePlanResult", "PlanCache", "plan_save"]


def _path_str(path: tuple) -> str:
    return "state_dict" + "".join(f"[{p!r}]" for p in path)


def _tensor_problem(t: torch.Tensor) -> str | None:
    if not t.is_nested and t.layout == torch.strided and not t.is_quantized and t.is_contiguous():
        # The common case, cheaply: a dense contiguous tensor needs storage for
        # storage_offset + numel elements.
        if t.device.type in ("cpu", "cuda"):
            if t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size():
                return None
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
    if t.numel():
        extent = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
        if t.untyped_storage().nbytes() < extent * t.element_size():
            return (
                "the tensor's storage is smaller than its shape needs (freed or resized storage, "
                "e.g. an FSDP-managed parameter outside its forward pass)"
            )
    return None


def validate_state_dict(state_dict: Any, max_depth: int = 200) -> None:
    """Refuse what cannot be saved, naming the offending entry.

    Accepted: nested ``dict`` (``str`` or ``int`` keys, as an optimizer's ``state``
    has: DCP stores ``str(key)``, asyncckpt records which were ``int``) and ``list``
    containers; strided CPU or
    CUDA tensors (DTensor included), of any dtype; other values that ``torch.save``
    can pickle.

    The walk is iterative (no ``RecursionError`` however deep the input), and
    ``max_depth`` keeps the input within what DCP's recursive flattening handles.

    Args:
        state_dict: the state to check.
        max_depth: the deepest container nesting accepted (levels of dicts / lists).

    Raises:
        CheckpointError: for the first offending entry (sparse, meta, quantized or
            nested tensor; a key neither ``str`` nor ``int`` (``bool`` included), or an
            ``int`` key beside the ``str`` of it; a container that contains itself;
            nesting deeper than ``max_depth``).
    """
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"state_dict must be a dict, not {type(state_dict).__name__}")
    # (path, value, ids of the containers above value)
    stack: list[tuple[tuple, Any, tuple[int, ...]]] = [((), state_dict, ())]
    while stack:
        path, value, above = stack.pop()
        if type(value) in _PLAIN_TENSOR_TYPES:  # the common leaf, before the ABC checks
            problem = _tensor_problem(value)
            if problem:
                raise CheckpointError(f"{_path_str(path)}: {problem}")
            continue
        if len(path) > max_depth:
            raise CheckpointError(f"{_path_str(path[:5])}...: nesting deeper than {max_depth} levels")
        if isinstance(value, (Mapping, list)):
            if id(value) in above:
                at = _path_str(path[: above.index(id(value))])
                raise CheckpointError(f"{_path_str(path)}: a cycle; this container is {at} itself")
            above = above + (id(value),)
        if isinstance(value, Mapping):
            for k, v in value.items():
                if type(k) is not str and type(k) is not int:
                    raise CheckpointError(
                        f"{_path_str(path)}: key {k!r} is a {type(k).__name__}; keys must be str or int "
                        "(torch.distributed.checkpoint names entries by str paths)"
                    )
                stack.append((path + (k,), v, above))
            clash = _key_clash(value.keys())
            if clash is not None:
                raise CheckpointError(
                    f"{_path_str(path)}: keys {clash!r} and {str(clash)!r} would both be stored as "
                    f"{str(clash)!r} (torch.distributed.checkpoint names entries by str paths)"
                )
        elif isinstance(value, list):
            for i, v in enumerate(value):
                stack.append((path + (i,), v, above))
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


def _key_clash(keys: Any) -> int | None:
    """An ``int`` key of ``keys`` whose ``str`` is also a key (both would be stored
    under one name), or ``None``."""
    ints = [k for k in keys if type(k) is int]
    if not ints:
        return None
    names = {k for k in keys if type(k) is str}
    if not names:  # an optimizer's `state`: int keys alone
        return None
    return next((k for k in ints if str(k) in names), None)


def _int_keys_ok(keys: tuple) -> bool:
    """Every key a ``str`` or an ``int`` (not ``bool``), no ``int`` beside its ``str``."""
    return all(type(k) is str or type(k) is int for k in keys) and _key_clash(keys) is None


def typed_path(state_dict: Any, path: tuple) -> tuple:
    """``path`` (DCP's flatten mapping of an entry: ``str(key)`` for dict keys, ``int``
    for list indices) with each dict key as it is in ``state_dict``: ``"0"`` becomes
    ``0`` where the dict holds the ``int`` key ``0`` and not the ``str`` ``"0"``.

    Raises:
        KeyError, IndexError, TypeError: ``path`` does not lead through ``state_dict``.
    """
    obj = state_dict
    out = []
    for k in path:
        if isinstance(obj, _Mapping) and type(k) is str and k not in obj:
            as_int = int_key(k)
            if as_int is not None and as_int in obj:
                k = as_int
        out.append(k)
        obj = obj[k]
    return tuple(out)


def int_positions(path: tuple, typed: tuple) -> tuple[int, ...]:
    """The positions where ``typed`` (:func:`typed_path` of ``path``) has an ``int`` dict
    key for ``path``'s ``str``."""
    return tuple(i for i, (a, b) in enumerate(zip(path, typed)) if type(a) is str and type(b) is int)


def _describe_item(item: Any) -> str:
    if item.type == WriteItemType.BYTE_IO:
        return "a non-tensor value"
    td = item.tensor_data
    kind = "a DTensor" if item.type == WriteItemType.SHARD else "a tensor"
    shape = "x".join(str(int(n)) for n in td.size) if len(td.size) else "scalar"
    return f"{kind} {str(td.properties.dtype).replace('torch.', '')}[{shape}]"


def check_plans_agree(plans: list[SavePlan], int_keys: list[dict[str, tuple[int, ...]]]) -> str | None:
    """Why the ranks' local plans cannot make one checkpoint, or ``None``.

    An entry (flattened key) that some ranks hold must be the same kind on each: a
    tensor (plain or DTensor) of the same dtype and (global) shape everywhere, or a
    non-tensor value everywhere; and its dict keys of the same types (``int_keys``: by
    rank, each entry's :func:`int_positions`). Otherwise DCP's global plan fails
    with an ``AssertionError`` (a tensor on one rank, a value on another) or keeps one
    rank's tensor and drops the others' in silence (a plain tensor whose shape or dtype
    differs). Reads only what the plans' all_gather brought (no collective).
    """
    seen: dict[str, tuple[int, Any, tuple, tuple[int, ...]]] = {}
    for rank, plan in enumerate(plans):
        keys = int_keys[rank] if rank < len(int_keys) else {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                what: tuple = ("value",)
            else:
                td = item.tensor_data
                what = ("tensor", td.properties.dtype, tuple(td.size)) if td is not None else ("tensor",)
            ints = keys.get(fqn, ())
            first = seen.setdefault(fqn, (rank, item, what, ints))
            if first[0] == rank:
                continue
            if first[2] != what:
                return (
                    f"state_dict entry {fqn!r} differs across ranks: {_describe_item(first[1])} on rank "
                    f"{first[0]}, {_describe_item(item)} on rank {rank} (a plain tensor saved by several "
                    "ranks must be the same on each; per-rank state needs per-rank keys, sharded state "
                    "DTensors)"
                )
            if first[3] != ints:
                return (
                    f"state_dict entry {fqn!r} differs across ranks: its dict keys at positions "
                    f"{list(first[3])} are int on rank {first[0]}, at {list(ints)} on rank {rank} "
                    "(the others str)"
                )
    return None


class SavePlanResult(NamedTuple):
    """This rank's part of a global save plan.

    Attributes:
        plan: this rank's final plan (what it writes).
        data: for each write item, the tensor (detached) or the ``torch.save`` bytes.
        metadata: the global DCP metadata (``storage_data`` filled in at commit).
        token: a random token, equal on all ranks (names the temporary directory).
        int_keys: the entries (of every rank) whose path has ``int`` dict keys: flattened
            key -> the positions in its ``metadata.planner_data`` path that are ``int``
            keys (DCP records ``str(key)``); recorded in the manifest so that
            ``read_state_dict`` gives the keys back as they were.
        peers: (the coordinator's, else empty) rank -> the other ranks whose files hold
            some of that rank's chunks (:func:`chunk_peers`), for the shard index.
    """

    plan: SavePlan
    data: list[Any]
    metadata: Metadata
    token: str
    int_keys: Mapping[str, tuple[int, ...]] = {}
    peers: Mapping[int, tuple[int, ...]] = {}


class PlanCache:
    """The last global save plan, reused while the state's structure is unchanged.

    DCP plans every save (a collective gather of local plans, dedup of replicated
    items, metadata), which costs tens of milliseconds per thousand tensors. The plan
    depends only on the state's structure, so a save whose structure equals the last
    one's on every rank (each rank compares its own, then one int64 all_gather of the
    "hit" flags) reuses it. The idea is DCP's own plan caching
    (``DefaultSavePlanner(enable_plan_caching=True)``), keyed here on the structure.

    The structure (:func:`structure_signature`) is, for every container, its kind and
    its keys (dicts, in order) or length (lists); for every plain tensor its type,
    dtype, shape and device; for a DTensor its local shard's dtype, shape and device,
    and from its ``DTensorSpec`` the device mesh, placements, global shape, stride and
    dtype (which, with this rank's place in the mesh, fix its local offsets, as
    ``compute_local_shape_and_global_offset`` computes them); for every other value
    only that it is one (its bytes are produced on every save, see ``pickled``).
    States with other tensor subclasses (ShardedTensor...) are planned afresh each time.

    Attributes:
        signature: the structure of the cached plan's state (a list compared with
            ``==``), or ``None``.
        plan: this rank's final plan of that state.
        metadata: the global DCP metadata of that plan (without ``storage_data`` and
            ``storage_meta``).
        paths: for each write item of ``plan``, the path of keys / indices to its value
            in the (``Stateful``-resolved) state_dict, as DCP's ``flatten_state_dict``
            maps it but with each dict key of its own type (:func:`typed_path`).
        int_keys: the plan's ``SavePlanResult.int_keys``.
        peers: the plan's ``SavePlanResult.peers``.
        pickled: for the plan's non-tensor items made of plain Python values
            (:func:`plain_key`), by the item's position in ``plan.items``: the value's
            ``pickle.dumps`` as of the last save, and the bytes ``torch.save`` made of
            it then. A value whose ``pickle.dumps`` is the same reuses those bytes: an
            optimizer's hyperparameters stay the same across saves, and each
            ``torch.save`` of one costs 60-100 µs (its zip container) against 2-3 µs
            for the comparison. Emptied whenever the plan changes.
    """

    def __init__(self) -> None:
        self.signature: list | None = None
        self.plan: SavePlan | None = None
        self.metadata: Metadata | None = None
        self.paths: list[tuple] | None = None
        self.pickled: dict[int, tuple[bytes, bytes]] = {}
        self.int_keys: Mapping[str, tuple[int, ...]] = {}
        self.peers: Mapping[int, tuple[int, ...]] = {}


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_Mapping = collections.abc.Mapping  # the ABC itself: typing.Mapping's isinstance is slower
_STRIDED = torch.strided
_SCALARS = (str, int, float, bool, type(None))
# Markers in a structure signature (compared by identity).
_DICT, _LIST, _VALUE = object(), object(), object()
_NOT_CACHEABLE = object()


def _is_dtensor(value: Any) -> TypeGuard[DTensor]:
    # Duck-typed, so that this module never imports torch.distributed.tensor: a value
    # with DTensor's to_local, placements and device_mesh is taken for one.
    return hasattr(value, "to_local") and hasattr(value, "placements") and hasattr(value, "device_mesh")


def _fast_ok(v: torch.Tensor) -> bool:
    """The common case of :func:`_tensor_problem` (a dense, contiguous CPU/CUDA tensor
    with all its storage), cheaply (about 0.7 µs: ``device.type`` alone costs 0.4, so
    the flags are read instead); ``False``: ask :func:`_tensor_problem`."""
    return (
        v.layout is _STRIDED
        and (v.is_cpu or v.is_cuda)
        and not v.is_quantized
        and not v.is_nested
        and v.is_contiguous()
        and v.untyped_storage().nbytes() >= v.storage_offset() * v.itemsize + v.nbytes
    )


def _dtensor_structure(v: Any) -> tuple:
    """What fixes a DTensor's plan, besides its local shard's shape and device: its
    mesh, placements, global shape, stride and dtype (and the order of its shards, on
    a torch that has one). Read from its ``DTensorSpec`` where there is one: the spec's
    fields are immutable objects that stay the same across the saves of a training run
    (an FSDP2 parameter or optimizer state keeps its DTensor), so the signature's
    comparison finds them identical at once; through the public properties otherwise.
    """
    spec = getattr(v, "_spec", None)
    if spec is not None and getattr(spec, "tensor_meta", None) is not None:
        return (spec.mesh, spec.placements, spec.tensor_meta, getattr(spec, "shard_order", None))
    return (v.device_mesh, tuple(v.placements), v.shape, v.dtype)


def _dtensor_class() -> type | None:
    """``DTensor`` if ``torch.distributed.tensor`` is imported (a state cannot hold one
    otherwise; this never imports it)."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):  # torch >= 2.5, 2.4
        cls = getattr(sys.modules.get(name), "DTensor", None)
        if cls is not None:
            return cls
    return None


def _walk(value: Any, sig: list, above: set[int], depth: int, max_depth: int, dtensor: type | None = None) -> Any:
    """Append the structure of the container ``value`` to ``sig``, checking every tensor.

    Returns ``None``; ``_NOT_CACHEABLE`` (a tensor subclass other than DTensor); or
    ``False`` on anything :func:`validate_state_dict` may refuse (the caller runs it
    then, for the error message). ``dtensor``: the ``DTensor`` class, checked first
    (FSDP2 states are thousands of them: about a quarter of the walk's time per
    DTensor went to the container and ``hasattr`` tests before).
    """
    if type(value) is dict or isinstance(value, _Mapping):
        keys = tuple(value.keys())
        for k in keys:
            if type(k) is not str:
                if not _int_keys_ok(keys):
                    return False
                break  # every key checked
        sig.append(_DICT)
        sig.append(keys)
        values: Any = value.values()
    else:
        sig.append(_LIST)
        sig.append(len(value))
        values = value
    result = None
    for v in values:
        t = type(v)
        if t is torch.Tensor or t is torch.nn.Parameter:
            if not _fast_ok(v) and _tensor_problem(v) is not None:
                return False
            sig += (t, v.dtype, v.shape, v.device)
        elif t is dtensor:
            local = v._local_tensor  # as to_local() gives it, without its autograd hop
            if not _fast_ok(local) and _tensor_problem(local) is not None:
                return False
            sig += (t, _dtensor_structure(v), local.dtype, local.shape, local.device)
        elif t in _SCALARS:
            sig.append(_VALUE)
        elif t is dict or t is list or isinstance(v, (_Mapping, list)):
            if depth >= max_depth or id(v) in above:
                return False
            above.add(id(v))
            got = _walk(v, sig, above, depth + 1, max_depth, dtensor)
            above.discard(id(v))
            if got is False:
                return False
            result = result or got
        elif isinstance(v, torch.Tensor):
            if not _is_dtensor(v):
                result = _NOT_CACHEABLE
                continue
            # The local shard as DTensor.to_local() gives it (without its autograd hop).
            local = getattr(v, "_local_tensor", None)
            if local is None:
                with torch.no_grad():
                    local = v.to_local()
            if not _fast_ok(local) and _tensor_problem(local) is not None:
                return False
            sig += (t, _dtensor_structure(v), local.dtype, local.shape, local.device)
        elif isinstance(v, tuple) and any(isinstance(e, torch.Tensor) for e in v):
            return False  # rare: tensors pickled inside a tuple, validated the slow way
        else:
            sig.append(_VALUE)
    return result


def structure_signature(state_dict: Any, max_depth: int = 200) -> list | None:
    """Validate ``state_dict`` and return its structure in the same walk (see :class:`PlanCache`).

    A few microseconds per tensor: the steady state's check of the plan cache.

    Args:
        state_dict: the state (``Stateful`` values already replaced by their state_dict).
        max_depth: as in :func:`validate_state_dict`.

    Returns:
        The signature (a list; equal lists mean equal plans), or ``None`` when the state
        holds tensor subclasses other than DTensor (planned afresh each time).

    Raises:
        CheckpointError: as :func:`validate_state_dict`, naming the offending entry.
    """
    if isinstance(state_dict, Mapping):
        sig: list = []
        got = _walk(state_dict, sig, {id(state_dict)}, 1, max_depth, _dtensor_class())
        if got is None:
            return sig
        if got is _NOT_CACHEABLE:
            return None
    validate_state_dict(state_dict, max_depth)  # raises, naming the entry
    return None


def _resolve_cached(cache: PlanCache, state_dict: Any) -> list[Any]:
    """This rank's data for the cached plan: one lookup path per write item (no flattening).

    Tensors as they are (a DTensor's local tensor); other values pickled afresh, or
    their last bytes where they are plain values equal to the last save's
    (``PlanCache.pickled``).

    Raises:
        CheckpointError: a value cannot be pickled.
    """
    assert cache.plan is not None and cache.paths is not None
    data: list[Any] = []
    append = data.append
    dtensor = _dtensor_class()
    byte_io = WriteItemType.BYTE_IO
    with torch.no_grad():  # DTensor.to_local() without autograd bookkeeping
        for i, (item, path) in enumerate(zip(cache.plan.items, cache.paths)):
            obj = state_dict
            for k in path:
                obj = obj[k]
            t = type(obj)
            if t is torch.Tensor or t is torch.nn.Parameter:
                append(obj)  # copied under no_grad (StagingCopier): no detach needed
            elif t is dtensor:
                append(obj._local_tensor)  # what to_local() returns under no_grad
            elif item.type is byte_io:
                append(_pickled_reusing(cache, i, item, obj))
            else:
                append(obj.to_local())
    return data


#: The most elements (containers and values) :func:`plain_key` looks at in one value.
PLAIN_KEY_MAX_ELEMENTS = 10_000
_PLAIN_ATOMS = frozenset((str, int, float, bool, type(None), bytes, complex))


def plain_key(obj: Any, max_elements: int = PLAIN_KEY_MAX_ELEMENTS) -> bytes | None:
    """``pickle.dumps(obj)`` if ``obj`` is a plain value, else ``None``.

    Plain: ``str``, ``int``, ``float``, ``bool``, ``None``, ``bytes``, ``complex``, and
    ``list`` / ``tuple`` / ``dict`` (exactly those types) of plain values, at most
    ``max_elements`` in all. For such values equal pickles mean values of the same
    types, equal bit for bit (``1``, ``1.0`` and ``True`` differ; so do ``0.0`` and
    ``-0.0``), with the same sharing of containers, so ``torch.save`` makes the same
    object of both. Anything else (a tensor, an arbitrary object whose pickle could
    hide state) gives ``None``.
    """
    todo = [obj]
    seen = 0
    while todo:
        v = todo.pop()
        t = type(v)
        seen += 1
        if seen > max_elements:
            return None
        if t in _PLAIN_ATOMS:
            continue
        if t is list or t is tuple:
            todo.extend(v)
        elif t is dict:
            todo.extend(v.keys())
            todo.extend(v.values())
        else:
            return None
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - e.g. too deep: torch.save decides
        return None


def _pickled_reusing(cache: PlanCache, i: int, item: Any, obj: Any) -> bytes:
    """:func:`_pickled`, reusing ``cache.pickled[i]``'s bytes when ``obj`` is a plain
    value whose pickle equals the remembered one (:func:`plain_key`); remembers new ones."""
    memo = cache.pickled
    key = plain_key(obj)
    if key is None:
        memo.pop(i, None)
        return _pickled(item, obj)
    last = memo.get(i)
    if last is not None and last[0] == key:
        return last[1]
    data = _pickled(item, obj)
    memo[i] = (key, data)
    return data


def _pickled(item: Any, obj: Any) -> bytes:
    try:
        if isinstance(obj, io.BytesIO):
            return obj.getvalue()
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()
    except Exception as exc:
        raise CheckpointError(
            f"state_dict entry {item.index.fqn!r} cannot be pickled: {type(exc).__name__}: {exc}"
        ) from exc


def _resolve(plan: SavePlan, lookup: Any) -> list[Any]:
    data: list[Any] = []
    for item in plan.items:
        try:
            obj = lookup(item)
        except Exception as exc:
            raise CheckpointError(
                f"state_dict entry {item.index.fqn!r} cannot be resolved: {type(exc).__name__}: {exc}"
            ) from exc
        data.append(_pickled(item, obj) if item.type == WriteItemType.BYTE_IO else obj.detach())
    return data


def plan_save(
    state_dict: dict[str, Any],
    checkpoint_id: str,
    sync: SyncGroup,
    coordinator_rank: int,
    precheck: Callable[[], None] | None = None,
    cache: PlanCache | None = None,
    finish: Callable[[SavePlanResult], Any] | None = None,
    agree: tuple[int, ...] = (),
    on_disagree: Callable[[list[list[int]]], None] | None = None,
    share: tuple[int, ...] = (),
    on_shared: Callable[[list[list[int]]], None] | None = None,
) -> tuple[SavePlanResult, Any]:
    """Validate, plan collectively (or reuse the cached plan), and resolve this rank's data.

    Call sequence (all ranks, every step a collective on ``sync`` except where said):

    1. (each rank) replace ``Stateful`` values by their ``state_dict()`` (as
       ``dcp.save`` does), validate it and take its structure signature in one walk
       (:func:`structure_signature`); (coordinator) run ``precheck``. (each rank whose
       signature equals its cached one) resolve its data by the cached paths (each
       write item's value looked up, no flattening) and run ``finish`` (e.g. the file
       layout) on the cached plan, ahead of knowing whether every rank hit.
    2. one int64 all_gather: failed?, cache hit?, the coordinator's random token, and
       ``agree`` and ``share``. A failure anywhere raises here, on every rank; so does a
       rank whose ``agree`` differs from another's (``on_disagree``); then every rank
       calls ``on_shared`` with every rank's ``share``. Every rank hit: done, with the
       plan and data of 1: the steady state costs this one collective.
    3. else DCP's ``DefaultSavePlanner`` (one all_gather of the local plans, then the
       same global plan on every rank); what 1 resolved is dropped.
    4. (each rank) resolve this rank's data, then ``finish``.
    5. the error funnel once more: a failure of 3-4 on any rank raises on every rank.

    Args:
        state_dict: the user's state_dict.
        checkpoint_id: the final checkpoint path (recorded in the metadata).
        sync: the ranks saving together.
        coordinator_rank: the rank that commits.
        precheck: run on the coordinator before planning (e.g. the target must not
            exist); its exception fails the save on every rank.
        cache: reuse and update this plan cache.
        finish: run on the resolved plan before the last error funnel; its return
            value is returned (its exceptions are funnelled like the others).
        agree: ints every rank must give equal (e.g. the step and a hash of the
            target), carried by the first all_gather (no collective of their own).
        on_disagree: called on every rank with every rank's ``agree`` when they
            differ; it raises (default: a :class:`CheckpointError` listing them).
        share: ints of this rank's that every rank receives, carried by the same
            all_gather (e.g. how far a manager's uploads are behind).
        on_shared: called on every rank with every rank's ``share`` (a list by rank),
            once the first all_gather found no failure: every rank gets the same.

    Returns:
        This rank's plan, and what ``finish`` returned (``None`` without it).

    Raises:
        CheckpointError: on every rank, if any rank's input is invalid, a value cannot
            be pickled, the precheck or ``finish`` failed; ``failures`` holds each
            failing rank's cause (type and errno kept), the message names the ranks.
    """
    is_coordinator = sync.rank == coordinator_rank
    failure: RankFailure | None = None
    signature: list | None = None
    try:
        state_dict = stateful_to_state_dict(state_dict)
        if cache is not None:
            signature = structure_signature(state_dict)  # validates, in the same walk
        else:
            validate_state_dict(state_dict)
        if is_coordinator and precheck is not None:
            precheck()
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        failure = _describe(exc)
    cached = (
        failure is None
        and cache is not None
        and signature is not None
        and cache.signature is not None
        and signature == cache.signature
    )
    storage_meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=uuid.uuid4().hex)
    hit: tuple[SavePlanResult, Any] | None = None
    data: list[Any] = []
    if cached:
        assert cache is not None and cache.plan is not None and cache.metadata is not None
        try:
            data = _resolve_cached(cache, state_dict)
            result = SavePlanResult(
                cache.plan,
                data,
                dataclasses.replace(cache.metadata, storage_meta=storage_meta),
                "",  # the token comes with the all_gather
                cache.int_keys,
                cache.peers,
            )
            hit = (result, finish(result) if finish is not None else None)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            failure = _describe(exc)
    token_parts = [secrets.randbits(63), secrets.randbits(63)] if is_coordinator else [0, 0]
    gathered = sync.all_gather_ints([failure is not None, cached, *token_parts, *agree, *share])
    if any(g[0] for g in gathered):
        _raise_errors(sync, sync.all_gather_object(failure))
    n = 4 + len(agree)
    if any(g[4:n] != gathered[0][4:n] for g in gathered):
        agreed = [g[4:n] for g in gathered]
        if on_disagree is not None:
            on_disagree(agreed)
        raise CheckpointError("the ranks disagree: " + "; ".join(f"rank {r}: {v}" for r, v in enumerate(agreed)))
    if on_shared is not None:
        on_shared([g[n:] for g in gathered])
    token = "".join(f"{v:016x}" for v in gathered[coordinator_rank][2:4])
    if all(g[1] for g in gathered):
        assert cache is not None and hit is not None
        return hit[0]._replace(token=token), hit[1]
    # Not every rank hit: DCP's planner, one all_gather of the local plans (with the
    # int dict keys of each rank's entries, which DCP's plans record as str).
    data = []
    planner = DefaultSavePlanner()
    local_plan: SavePlan | None = None
    typed: dict[str, tuple] = {}  # this rank's entries: flattened key -> path with its keys' types
    local_ints: dict[str, tuple[int, ...]] = {}
    try:
        planner.set_up_planner(state_dict, storage_meta=storage_meta, is_coordinator=is_coordinator)
        local_plan = planner.create_local_plan()
        for item in local_plan.items:
            fqn = item.index.fqn
            path = tuple(planner.mappings[fqn])
            typed[fqn] = typed_path(state_dict, path)
            ints = int_positions(path, typed[fqn])
            if ints:
                local_ints[fqn] = ints
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        failure = _describe(exc)
    gathered_plans = sync.all_gather_object((failure, local_plan, local_ints))
    _raise_errors(sync, [f for f, _, _ in gathered_plans])
    local_plans = [p for _, p, _ in gathered_plans]
    # Every rank has every local plan: the same checks give the same error on each rank.
    problem = check_plans_agree(local_plans, [k for _, _, k in gathered_plans])
    if problem is not None:
        raise CheckpointError(problem)
    int_keys = {fqn: ints for _, _, k in gathered_plans for fqn, ints in k.items()}
    try:
        global_plans, metadata = planner.create_global_plan(local_plans)
    except Exception as exc:  # deterministic: the same on every rank
        raise CheckpointError(f"planning {checkpoint_id} failed: {type(exc).__name__}: {exc}") from exc
    if metadata.storage_meta is None:  # as a cached plan's (and dcp.save's) metadata has it
        metadata = dataclasses.replace(metadata, storage_meta=storage_meta)
    plan = planner.finish_plan(global_plans[sync.rank])
    peers = chunk_peers(local_plans, global_plans) if is_coordinator else {}
    try:
        data = _resolve(plan, planner.resolve_data)
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        failure = _describe(exc)
    if cache is not None:
        # A state that cannot be cached (or failed) leaves no plan to reuse.
        cache.signature = cache.plan = cache.metadata = cache.paths = None
        cache.int_keys, cache.peers = {}, {}
        cache.pickled.clear()
        if signature is not None and failure is None:
            try:
                cache.paths = [typed[item.index.fqn] for item in plan.items]
            except KeyError:
                pass  # not found as DCP flattened it: plan afresh next time
            else:
                cache.signature, cache.plan, cache.int_keys, cache.peers = signature, plan, int_keys, peers
                cache.metadata = dataclasses.replace(metadata, storage_data=None, storage_meta=None)
    result = SavePlanResult(plan, data, metadata, token, int_keys, peers)
    finished = None
    if failure is None and finish is not None:
        try:
            finished = finish(result)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            failure = _describe(exc)
    # A failure of this rank's resolve or finish: still symmetric, every rank learns it.
    failures = sync.gather_failures(failure)
    if failures:
        _raise_errors(sync, [failures.get(r) for r in range(sync.world_size)])
    return result, finished


def chunk_peers(local_plans: list[SavePlan], global_plans: list[SavePlan]) -> dict[int, tuple[int, ...]]:
    """For each rank, the other ranks whose files hold some of the chunks it planned to
    write: DCP's planner writes a chunk that several ranks hold (an HSDP shard, on each
    replica of it) once, in one of their files (``dedup_save_plans``, which shares such
    chunks out between them). A load with the save's sharding then finds a rank's chunks
    in its own file and in these ranks' files. Only chunks of part of a tensor count
    (``WriteItemType.SHARD`` items smaller than their tensor): entries saved whole are
    found in the shard index itself. Ranks with no such chunk elsewhere are left out.

    Args:
        local_plans: each rank's local plan, before the dedup (index: rank).
        global_plans: each rank's plan after it (index: rank).
    """
    if all(len(g.items) == len(lp.items) for g, lp in zip(global_plans, local_plans)):
        return {}  # the dedup moved nothing (FSDP, tensor parallel): no pass over the items
    shard = WriteItemType.SHARD

    def part_of_a_tensor(item: Any) -> bool:
        td = item.tensor_data
        return item.type is shard and td is not None and tuple(td.chunk.sizes) != tuple(td.size)

    writer: dict[tuple[str, tuple[int, ...]], int] = {}
    for rank, plan in enumerate(global_plans):
        for item in plan.items:
            if part_of_a_tensor(item):
                writer[(item.index.fqn, tuple(item.index.offset or ()))] = rank
    peers: dict[int, tuple[int, ...]] = {}
    for rank, plan in enumerate(local_plans):
        others = {
            writer.get((item.index.fqn, tuple(item.index.offset or ())), rank)
            for item in plan.items
            if part_of_a_tensor(item)
        }
        others.discard(rank)
        if others:
            peers[rank] = tuple(sorted(others))
    return peers


def stateful_to_state_dict(state_dict: Any) -> Any:
    """A shallow copy of ``state_dict`` whose top-level ``Stateful`` values (objects with
    ``state_dict()`` / ``load_state_dict()``) are replaced by their ``state_dict()``,
    as ``torch.distributed.checkpoint.save`` does; ``dcp.load`` (and so
    :func:`asyncckpt.load`) calls their ``load_state_dict()`` back. Not a dict: as is."""
    if not isinstance(state_dict, Mapping) or not any(_is_stateful(v) for v in state_dict.values()):
        return state_dict
    return {k: v.state_dict() if _is_stateful(v) else v for k, v in state_dict.items()}


#: Values that are never ``Stateful``: the Protocol's ``isinstance`` (``inspect``-based,
#: about 17 µs) is asked only of others (it cost 70 ms per save of 4096 top-level tensors).
_NEVER_STATEFUL = (torch.Tensor, dict, list, tuple, str, int, float, bool, type(None))


def _is_stateful(value: Any) -> bool:
    return not isinstance(value, _NEVER_STATEFUL) and isinstance(value, Stateful)


def _describe(exc: BaseException) -> RankFailure:
    """A short failure for an input error: the message (a CheckpointError's as is),
    the exception's type and errno, no traceback (the message names the entry)."""
    text = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    full = RankFailure.from_exception(exc)
    return RankFailure(text, full.exc_type, full.errno, full.exception)


def _raise_errors(sync: SyncGroup, failures: list[RankFailure | None]) -> None:
    found = {r: f for r, f in enumerate(failures) if f is not None}
    if not found:
        return
    if sync.world_size == 1:
        raise CheckpointError(str(found[0]), found)
    raise CheckpointError("; ".join(f"rank {r}: {f}" for r, f in found.items()), found)
