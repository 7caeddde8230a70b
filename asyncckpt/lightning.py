"""A Lightning ``CheckpointIO`` plugin: asynchronous, atomic DCP checkpoints.

One module over 600 lines, on purpose: it is the import path users write, and
checkpoints on disk pickle ``asyncckpt.lightning._TensorRef``, so the codec stays here
with the plugin (its directory swap is :mod:`asyncckpt.io.swap`).

``Trainer(plugins=[AsyncckptCheckpointIO()])`` makes every checkpoint Lightning writes
(``ModelCheckpoint``, ``trainer.save_checkpoint``) an asyncckpt save: the training
thread is blocked only while the state is copied into a reused host buffer; a
background process writes the files; the checkpoint appears under its name, complete
and checksummed, or not at all. Install with ``pip install 'asyncckpt[lightning]'``;
``import asyncckpt`` never imports Lightning, only ``import asyncckpt.lightning`` does.

Layout. Lightning's path (``.../epoch=0-step=100.ckpt``) becomes a directory of that
name: a ``torch.distributed.checkpoint`` directory plus ``.manifest.json``. Its tensors
are stored under their own nested keys (``state_dict`` -> ``layer.weight``,
``optimizer_states`` -> ``0`` -> ``state`` -> ``0`` -> ``exp_avg``, ...; dict keys and
list indices as strings), so stock tools (``dcp.load``, :func:`asyncckpt.read_state_dict`,
``asyncckpt convert``) see them. DCP cannot represent everything a Lightning checkpoint
holds (it turns dict keys into strings, tuples holding tensors into lists, drops empty
dicts, and flattens ``OrderedDict`` / ``AttributeDict`` into plain dicts), so the
structure itself (every non-tensor value, every container type and key, with a
placeholder for each tensor) is also stored, pickled, under the key
``"__asyncckpt_lightning__"``: :meth:`AsyncckptCheckpointIO.load_checkpoint` returns the
dict that was saved, types and keys included.

When a save commits. A save is committed (renamed into place) by the first call of
this plugin after its write finished (``save_checkpoint``, ``remove_checkpoint``,
``load_checkpoint``), or by ``teardown`` (at the end of ``fit``/``validate``/...),
which waits for all of them, or by :meth:`AsyncckptCheckpointIO.wait`; saves still
pending when the process exits (e.g. a ``trainer.save_checkpoint`` after ``fit``, or
the final weights a spawn-based strategy hands to the main process) are committed at
exit.

Distributed training. Lightning calls ``checkpoint_io.save_checkpoint`` on global rank
0 only (``Strategy.save_checkpoint`` checks ``is_global_zero``), with the full state
(DDP replicates it). The plugin therefore saves from that rank alone: it issues no
collective, using a process group of its own that holds that rank only (created with
``use_local_synchronization=True``, so the other ranks take no part). Strategies that
save sharded state through their own code path (FSDP's or DeepSpeed's sharded state
dicts) do not go through a ``CheckpointIO`` and are not covered. Every rank may call
``load_checkpoint`` (a read of the whole checkpoint in each process, no collective);
only rank 0 knows of its pending saves, so another rank must not load a checkpoint
rank 0 may still be writing (Lightning loads ``ckpt_path`` before training starts).

Not covered: ``LightningModule.load_from_checkpoint`` reads files with ``torch.load``
itself, without the plugin; load the state dict through it instead:
``model.load_state_dict(AsyncckptCheckpointIO().load_checkpoint(path)["state_dict"])``.
"""

from __future__ import annotations

import copy
import errno
import functools
import io
import logging
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:
    from lightning.fabric.plugins.io.checkpoint_io import (
        CheckpointIO,  # = lightning.pytorch.plugins.io.CheckpointIO
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("asyncckpt.lightning needs Lightning: pip install 'asyncckpt[lightning]'") from exc

from asyncckpt import (
    AsyncCallsQueue,
    SaveHandle,
    SaveResult,
    _exit,
    read_state_dict,
    save,
)
from asyncckpt._fs import remove_checkpoint
from asyncckpt.errors import CheckpointError, CheckpointNotFoundError, CheckpointPathError, InvalidArgumentError
from asyncckpt.format import manifest as _manifest
from asyncckpt.io.swap import remove_path, replace_path

__all__ = ["AsyncckptCheckpointIO", "STRUCTURE_KEY"]

_log = logging.getLogger("asyncckpt")

#: The top-level key of the saved tree that holds the pickled structure.
STRUCTURE_KEY = "__asyncckpt_lightning__"


# ----------------------------------------------------------------------------- encoding
class _TensorRef:
    """Placeholder of a tensor in the stored structure: the key path of the tensor in
    the saved tree (loadable with ``weights_only=True`` once allowlisted)."""

    __slots__ = ("path",)

    def __init__(self, path: tuple[str, ...]) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (_TensorRef, (self.path,))


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields") and hasattr(type(obj), "_make")


def _split(obj: Any, path: tuple[str, ...], tensors: list[tuple[_TensorRef, torch.Tensor]]) -> Any:
    """``obj`` with every reachable tensor replaced by a :class:`_TensorRef`.

    Reachable: values of dicts (of any dict subclass), items of lists and tuples
    (named tuples included). Containers holding no tensor are returned as they are;
    the others are copied (same type, ``copy.copy`` for dict subclasses). Tensors
    inside other objects stay in them (and are pickled with the structure).
    """
    if isinstance(obj, torch.Tensor):
        ref = _TensorRef(path)
        tensors.append((ref, obj))
        return ref
    if isinstance(obj, dict):
        out = None
        used: set[str] = set()
        for key, value in obj.items():
            segment = _segment(key, used)
            new = _split(value, path + (segment,), tensors)
            if new is not value:
                if out is None:
                    out = copy.copy(obj)
                out[key] = new
        return obj if out is None else out
    if type(obj) is list or type(obj) is tuple or _is_namedtuple(obj):
        items = [_split(v, path + (str(i),), tensors) for i, v in enumerate(obj)]
        if all(new is old for new, old in zip(items, obj)):
            return obj
        if type(obj) is list:
            return items
        return tuple(items) if type(obj) is tuple else type(obj)._make(items)
    return obj


def _segment(key: Any, used: set[str]) -> str:
    """A key's name in the saved tree: ``str(key)``, made unique within its dict."""
    name = key if isinstance(key, str) else str(key)
    candidate, n = name, 1
    while candidate in used:
        candidate = f"{name}#{n}"
        n += 1
    used.add(candidate)
    return candidate


def encode(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The tree that is saved for a Lightning checkpoint dict.

    Returns:
        Nested dicts with ``str`` keys holding the tensors (no copy), and, under
        :data:`STRUCTURE_KEY`, the ``torch.save`` bytes of the structure (``checkpoint``
        with each tensor replaced by a placeholder naming its place in the tree).
    """
    tensors: list[tuple[_TensorRef, torch.Tensor]] = []
    structure = _split(checkpoint, (), tensors)
    tree: dict[str, Any] = {}
    fqns = {STRUCTURE_KEY}
    for ref, tensor in tensors:
        path = ref.path
        if not path or path[0] == STRUCTURE_KEY:
            path = ("tensors",) + path
        # DCP names entries by the dotted path: keep every name unique ("a.b" vs a -> b).
        n = 1
        while ".".join(path) in fqns:
            path = path[:-1] + (f"{ref.path[-1] if ref.path else 'tensor'}#{n}",)
            n += 1
        fqns.add(".".join(path))
        ref.path = path
        node = tree
        for segment in path[:-1]:
            node = node.setdefault(segment, {})
        node[path[-1]] = tensor
    buf = io.BytesIO()
    torch.save(structure, buf)
    tree[STRUCTURE_KEY] = buf.getvalue()
    return tree


def _lookup(tree: dict[str, Any], path: tuple[str, ...], where: str) -> torch.Tensor:
    node: Any = tree
    for segment in path:
        if not isinstance(node, dict) or segment not in node:
            raise CheckpointError(f"{where}: the structure names a tensor at {path!r}, which the checkpoint lacks")
        node = node[segment]
    if not isinstance(node, torch.Tensor):
        raise CheckpointError(
            f"{where}: the structure names a tensor at {path!r}, the checkpoint has a {type(node).__name__} there"
        )
    return node


def _join(obj: Any, tree: dict[str, Any], where: str, seen: dict[int, Any]) -> Any:
    """Put the tensors of ``tree`` back in place of the placeholders of ``obj`` (in place
    for dicts and lists, which are fresh from unpickling)."""
    if isinstance(obj, _TensorRef):
        return _lookup(tree, tuple(obj.path), where)
    if id(obj) in seen:  # shared or cyclic containers: each is rebuilt once
        return seen[id(obj)]
    if isinstance(obj, dict):
        seen[id(obj)] = obj
        for key, value in list(obj.items()):
            new = _join(value, tree, where, seen)
            if new is not value:
                obj[key] = new
        return obj
    if type(obj) is list:
        seen[id(obj)] = obj
        for i, value in enumerate(obj):
            new = _join(value, tree, where, seen)
            if new is not value:
                obj[i] = new
        return obj
    if type(obj) is tuple or _is_namedtuple(obj):
        items = [_join(v, tree, where, seen) for v in obj]
        if all(new is old for new, old in zip(items, obj)):
            out = obj
        else:
            out = tuple(items) if type(obj) is tuple else type(obj)._make(items)
        seen[id(obj)] = out
        return out
    return obj


def decode(tree: dict[str, Any], *, allow_pickle: bool, where: str = "checkpoint") -> dict[str, Any]:
    """The checkpoint dict that :func:`encode` turned into ``tree``.

    A tree without :data:`STRUCTURE_KEY` (a checkpoint not written by this plugin) is
    returned as it is.

    Raises:
        CheckpointError: the structure holds objects that ``weights_only`` loading
            refuses and ``allow_pickle`` is false; or it names a tensor the tree lacks.
    """
    blob = tree.pop(STRUCTURE_KEY, None)
    if blob is None:
        return tree
    if not isinstance(blob, (bytes, bytearray)):
        raise CheckpointError(f"{where}: {STRUCTURE_KEY!r} holds a {type(blob).__name__}, not bytes")
    try:
        with torch.serialization.safe_globals([_TensorRef]):
            structure = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=not allow_pickle)
    except Exception as exc:
        if not allow_pickle and "Weights only load failed" in str(exc):
            reason = next(
                (
                    line.split("WeightsUnpickler error:", 1)[1].strip()
                    for line in str(exc).splitlines()
                    if "WeightsUnpickler error:" in line
                ),
                str(exc).splitlines()[0],
            )
            raise CheckpointError(
                f"{where} holds Python objects that weights_only loading refuses ({reason}); load it with "
                "AsyncckptCheckpointIO(allow_pickle=True) / weights_only=False if you trust where it comes "
                "from, or allowlist the classes with torch.serialization.safe_globals([...])"
            ) from None
        raise CheckpointError(f"{where}: the stored structure cannot be read: {type(exc).__name__}: {exc}") from exc
    return _join(structure, tree, where, {})


# ----------------------------------------------------------------------------- exit
_open_plugins: dict[int, AsyncckptCheckpointIO] = {}  # id -> plugin whose saves may be pending
_open_lock = threading.Lock()


def _commit_all_at_exit() -> None:
    """The exit phase ``COMMIT_LIGHTNING`` (before the other pending saves are settled
    and the writers stopped): tear down every plugin of this process with pending
    saves, so that they commit and are swapped into place."""
    with _open_lock:
        plugins = list(_open_plugins.values())
    for plugin in plugins:
        try:
            plugin.teardown()
        except Exception as exc:  # noqa: BLE001 - at exit: report, go on with the others
            _log.error("asyncckpt: a checkpoint pending at exit failed: %s", exc)


def _forget_plugins_in_child() -> None:
    """A forked child: the plugins' saves are its parent's."""
    global _open_lock
    _open_lock = threading.Lock()
    _open_plugins.clear()


_exit.register(_exit.COMMIT_LIGHTNING, _commit_all_at_exit, forget=_forget_plugins_in_child)


# ----------------------------------------------------------------------------- the plugin
class AsyncckptCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing asynchronous, atomic asyncckpt checkpoints.

    ``Trainer(plugins=[AsyncckptCheckpointIO()])``. Each ``save_checkpoint`` stages the
    checkpoint (a copy into a reused host buffer: the only time training waits) and
    returns; a background worker process writes the files; the checkpoint directory
    appears at ``path`` once complete (see the module documentation for when).
    Saving to an existing checkpoint's path (``last.ckpt``) writes a new directory
    beside it and swaps it in atomically when it commits.

    Args:
        allow_pickle: load non-tensor values of any class (``torch.load`` with
            ``weights_only=False``). Lightning checkpoints hold such values
            (hyper-parameters as ``AttributeDict``, ``pathlib`` paths, dataclasses,
            enums, callback states), and the checkpoints this plugin loads are
            normally the ones the same user's training wrote, so the default is
            ``True``. Unpickling runs code chosen by whoever wrote the checkpoint: pass
            ``False`` to load checkpoints from elsewhere (only ``weights_only``-safe
            values then load). A ``weights_only`` argument given by Lightning to
            :meth:`load_checkpoint` takes precedence.
        verify_on_load: check every file's size and CRC-32 against the manifest before
            loading (reads the checkpoint twice; default ``True``).
        start_method: ``"spawn"`` or ``"forkserver"`` for the background writer.

    Raises (from the methods):
        CheckpointException: a save failed (raised by the next call of this plugin,
            or by ``teardown``).
        CheckpointError: a checkpoint cannot be loaded as asked (see
            :func:`asyncckpt.read_state_dict`).
    """

    def __init__(self, *, allow_pickle: bool = True, verify_on_load: bool = True, start_method: str = "spawn") -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        self.verify_on_load = verify_on_load
        self.start_method = start_method
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._queue: AsyncCallsQueue | None = None
        self._queue_group: Any = None
        self._group: Any = None
        self._group_key: Any = None
        self._pending: list[tuple[str, SaveHandle]] = []  # (final path, handle), in save order
        self._removals: list[threading.Thread] = []

    # Lightning pickles the trainer (and its plugins) to start spawned ranks.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_queue", "_queue_group", "_group", "_group_key"):
            state[name] = None
        state["_pending"], state["_removals"] = [], []
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- process group and queue
    def _process_group(self) -> Any:
        """``None`` (one process, or a default group of one), else a group of this rank alone."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        key = (id(dist.group.WORLD), dist.get_rank())
        if self._group is None or self._group_key != key:
            # Only this rank calls it: local synchronization, no collective on the others.
            self._group = dist.new_group(ranks=[dist.get_rank()], backend="gloo", use_local_synchronization=True)
            self._group_key = key
        return self._group

    def _ensure_queue(self) -> AsyncCallsQueue:
        group = self._process_group()
        if self._queue is not None and self._queue_group is not group:
            self.teardown()
        if self._queue is None:
            queue = AsyncCallsQueue(
                persistent=True,
                process_group=group,
                start_method=self.start_method,
                import_main=False if self.start_method == "spawn" else None,
            )
            start = getattr(queue.caller, "start", None)
            if start is not None:
                start()
            self._queue, self._queue_group = queue, group
            _exit.arm()  # at its exit, this process commits the pending saves (a rank started by multiprocessing too)
            with _open_lock:
                _open_plugins[id(self)] = self
        return self._queue

    # -- bookkeeping of pending saves
    def _reap(self) -> None:
        """Commit the saves whose write finished (no waiting); raise the first failure."""
        while self._pending:
            _, handle = self._pending[0]
            if not handle.done():  # done() only reads: the commit is run by wait() below
                queue = self._queue
                if queue is None or handle.call_idx is None or not queue.wait_local(handle.call_idx, 0):
                    break  # still writing
            self._pending.pop(0)
            handle.wait()  # commits (this rank's queue alone); failed: raises (also a callback's error)
        self._removals = [t for t in self._removals if t.is_alive()]

    def _wait_for(self, path: str) -> None:
        """Commit every pending save up to the last one of ``path`` (waiting for them)."""
        last = max((i for i, (p, _) in enumerate(self._pending) if p == path), default=None)
        if last is None:
            self._reap()
            return
        todo, self._pending = self._pending[: last + 1], self._pending[last + 1 :]
        first_error: BaseException | None = None
        for _, handle in todo:
            try:
                handle.wait()
            except Exception as exc:  # noqa: BLE001 - the first failure is raised once every save is settled
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def _swap_in(self, new: Path, final: Path, outcome: Any) -> None:
        """Completion callback of a save to a path that existed: swap the new directory in."""
        if not isinstance(outcome, SaveResult):
            return  # failed: nothing was committed (the failure is raised by wait)
        old = replace_path(new, final)
        if old is not None:
            thread = threading.Thread(target=remove_path, args=(old,), name="asyncckpt-lightning-remove", daemon=True)
            thread.start()
            self._removals.append(thread)

    # -- CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Start saving ``checkpoint`` as the checkpoint directory ``path``; return once staged.

        Args:
            checkpoint: Lightning's checkpoint dict (tensors on any device, Python values).
            path: the checkpoint's path (Lightning's ``....ckpt``): it becomes a directory.
                An existing checkpoint there is replaced atomically once the new one
                commits.
            storage_options: not supported (must be ``None``), as in ``TorchCheckpointIO``.

        Raises:
            InvalidArgumentError: (a ``TypeError``) ``storage_options`` was given.
            CheckpointPathError: (a ``FileExistsError``) ``path`` is a non-empty
                directory that is not a checkpoint.
            CheckpointException: an earlier save failed.
            CheckpointError: the checkpoint cannot be saved (e.g. a tensor of an
                unsupported kind).
        """
        if storage_options is not None:
            raise InvalidArgumentError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}"
            )
        final = Path(path).absolute()
        key = _key(final)
        self._reap()
        final.parent.mkdir(parents=True, exist_ok=True)
        tree = encode(checkpoint)
        callback: Callable[[Any], None] | None = None
        target = final
        pending = any(p == key for p, _ in self._pending)
        if pending or os.path.lexists(final):
            if (
                not pending
                and final.is_dir()
                and not final.is_symlink()
                and not os.path.lexists(final / _manifest.METADATA_NAME)
                and any(final.iterdir())
            ):
                raise CheckpointPathError.of(
                    errno.EEXIST, "a directory that is not a checkpoint; not replacing it", final
                )
            # Written beside it, swapped in when it commits: `final` always names a whole checkpoint.
            target = final.parent / f".{final.name}.asyncckpt-new-{secrets.token_hex(6)}"
            callback = functools.partial(self._swap_in, target, final)
        queue = self._ensure_queue()
        step = checkpoint.get("global_step")  # recorded in the manifest: `asyncckpt ls` shows it
        handle = save(
            tree,
            target,
            async_op=True,
            calls_queue=queue,
            process_group=self._queue_group,
            callback=callback,
            step=step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None,
        )
        self._pending.append((key, handle))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint at ``path`` (waiting first for a pending save of it).

        A directory is read with :func:`asyncckpt.read_state_dict` (checksums verified
        with ``verify_on_load``) and returned as the dict that was saved; a regular
        file (a ``torch.save`` checkpoint of ``TorchCheckpointIO``) with ``torch.load``.

        Args:
            path: the checkpoint.
            map_location: ``None`` (CPU tensors), a device (``torch.device`` or string)
                to move every tensor to, or a dict mapping ``"cpu"`` to one.
            weights_only: ``True``: only ``weights_only``-safe values load; ``False``:
                any pickled value; ``None``: the plugin's ``allow_pickle``.

        Returns:
            The checkpoint dict.

        Raises:
            CheckpointNotFoundError: (a ``FileNotFoundError``) ``path`` does not exist.
            InvalidArgumentError: (a ``TypeError``) ``map_location`` is of another kind
                (e.g. a callable).
            CorruptCheckpointError: the checkpoint is corrupt (see ``read_state_dict``).
            CheckpointError: a value needs ``weights_only=False`` / ``allow_pickle``.
            CheckpointException: the pending save of ``path`` (or an earlier one) failed.
        """
        final = Path(path).absolute()
        self._wait_for(_key(final))
        device = _target_device(map_location)
        if not os.path.lexists(final):
            raise CheckpointNotFoundError("Checkpoint file not found", str(path))
        allow = self.allow_pickle if weights_only is None else not weights_only
        if final.is_file():
            return torch.load(final, map_location=device or "cpu", weights_only=not allow)
        tree = read_state_dict(final, verify=self.verify_on_load, allow_pickle=allow)
        checkpoint = decode(tree, allow_pickle=allow, where=str(final))
        if device is not None and device != torch.device("cpu"):
            checkpoint = _to_device(checkpoint, device)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` (waiting first for a pending save of it).

        The directory is renamed to a hidden name at once (so ``path`` is gone when
        this returns) and deleted in a background thread (joined by ``teardown``).

        Raises:
            CheckpointException: the pending save of ``path`` (or an earlier one) failed.
        """
        final = Path(path).absolute()
        self._wait_for(_key(final))
        if not os.path.lexists(final):
            return
        if final.is_dir() and not final.is_symlink():
            thread = remove_checkpoint(final, background=True)
            if thread is not None:
                self._removals.append(thread)
        else:
            os.unlink(final)

    def wait(self, path: Any = None) -> None:
        """Block until the pending saves are committed: all of them, or (``path``) every
        one up to the last save of ``path``. The writer keeps running (unlike ``teardown``).

        Raises:
            CheckpointException: one of those saves failed.
            CallbackError: replacing an existing checkpoint by a new one failed.
        """
        if path is not None:
            self._wait_for(_key(Path(path)))
            return
        if self._pending:
            self._wait_for(self._pending[-1][0])

    def teardown(self) -> None:
        """Wait for every pending save, commit it, and stop the background writer.

        Called by Lightning at the end of ``fit``/``validate``/``test``/``predict``;
        the next save starts a new writer.

        Raises:
            CheckpointException: a pending save failed (the first failure; the others
                are still committed or dropped).
            CallbackError: replacing an existing checkpoint by a new one failed.
        """
        first_error: BaseException | None = None
        pending, self._pending = self._pending, []
        for _, handle in pending:
            try:
                handle.wait()
            except Exception as exc:  # noqa: BLE001 - the first failure is raised once every save is settled
                first_error = first_error or exc
        queue, self._queue, self._queue_group = self._queue, None, None
        if queue is not None:
            try:
                queue.close()
            except Exception as exc:  # noqa: BLE001 - the first failure is raised once every save is settled
                first_error = first_error or exc
        for thread in self._removals:
            thread.join()
        self._removals = []
        with _open_lock:
            _open_plugins.pop(id(self), None)
        if first_error is not None:
            raise first_error


def _key(path: Path) -> str:
    """The name pending saves are kept under: symlinks resolved (``save_last="link"``
    makes ``last.ckpt`` a link to a checkpoint that may still be pending)."""
    return os.path.realpath(path)


def _target_device(map_location: Any) -> torch.device | None:
    if map_location is None:
        return None
    if isinstance(map_location, dict):
        map_location = map_location.get("cpu")
        if map_location is None:
            return None
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise InvalidArgumentError(
        f"map_location must be None, a device or a dict mapping 'cpu' to one, not {type(map_location).__name__}"
    )


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            obj[key] = _to_device(value, device)
        return obj
    if type(obj) is list:
        return [_to_device(v, device) for v in obj]
    if type(obj) is tuple:
        return tuple(_to_device(v, device) for v in obj)
    return obj
