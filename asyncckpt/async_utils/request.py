"""AsyncRequest: one unit of asynchronous work.

The shape is Megatron-core's ``dist_checkpointing.strategies.async_utils.AsyncRequest``:
``preload_fn`` runs in the training process when the request is scheduled (staging),
``async_fn`` runs in the background (a forked child or a persistent worker), and the
``finalize_fns`` run in the training process once the call succeeded on every rank.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from asyncckpt.errors import InvalidStateError

__all__ = ["AsyncRequest"]

_AsyncRequestBase = namedtuple(
    "_AsyncRequestBase",
    [
        "async_fn",
        "async_fn_args",
        "finalize_fns",
        "async_fn_kwargs",
        "preload_fn",
        "is_frozen",
        "call_idx",
    ],
)


class AsyncRequest(_AsyncRequestBase):
    """A request to run ``async_fn`` in the background and ``finalize_fns`` afterwards.

    A ``NamedTuple`` with the fields (in this order):

    - ``async_fn`` (``Callable | None``): runs in the background. For the persistent
      caller it must be picklable (a module-level function); its return value is
      sent back to the training process (see ``AsyncCallsQueue.get_result``).
    - ``async_fn_args`` (``tuple``, default ``()``): positional arguments.
    - ``finalize_fns`` (``Sequence[Callable[[], None]]``, default ``()``): run without
      arguments, in order, in the training process, only if the call succeeded on
      every rank.
    - ``async_fn_kwargs`` (``dict | None``, default ``None``): keyword arguments.
    - ``preload_fn`` (``Callable[[], Any] | None``, default ``None``): runs in the
      training process inside ``schedule_async_request`` (e.g. staging D2H copies);
      its return value is passed to ``async_fn`` as the first positional argument,
      before ``async_fn_args``.
    - ``is_frozen`` (``bool``): set by :meth:`freeze`; a frozen request takes no more
      finalize functions.
    - ``call_idx`` (``int``): assigned by ``AsyncCallsQueue.schedule_async_request``.

    Unlike a plain NamedTuple, an unfrozen request keeps ``finalize_fns`` as a list so
    that :meth:`add_finalize_fn` can append in place, as in Megatron-core.
    """

    __slots__ = ()

    def __new__(
        cls,
        async_fn: Callable[..., Any] | None,
        async_fn_args: tuple = (),
        finalize_fns: Iterable[Callable[[], Any]] = (),
        async_fn_kwargs: dict[str, Any] | None = None,
        preload_fn: Callable[[], Any] | None = None,
        is_frozen: bool = False,
        call_idx: int = 0,
    ) -> AsyncRequest:
        fns: Sequence[Callable[[], Any]] = tuple(finalize_fns) if is_frozen else list(finalize_fns)
        return super().__new__(
            cls,
            async_fn,
            tuple(async_fn_args),
            fns,
            async_fn_kwargs,
            preload_fn,
            bool(is_frozen),
            int(call_idx),
        )

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Append ``fn`` to ``finalize_fns``.

        Raises:
            InvalidStateError: (a ``RuntimeError``) the request is frozen (it was already scheduled).
        """
        if self.is_frozen:
            raise InvalidStateError("cannot add a finalize function to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def freeze(self) -> AsyncRequest:
        """Return a frozen copy (finalize_fns become an immutable tuple)."""
        return self._replace(is_frozen=True, finalize_fns=tuple(self.finalize_fns))

    def execute_sync(self) -> Any:
        """Run the whole request in this process: preload, async_fn, finalize_fns.

        Returns:
            The return value of ``async_fn`` (``None`` if there is none).

        Raises:
            Whatever ``preload_fn``, ``async_fn`` or a finalize function raises.
        """
        args = self.async_fn_args
        if self.preload_fn is not None:
            args = (self.preload_fn(),) + tuple(args)
        result = None
        if self.async_fn is not None:
            result = self.async_fn(*args, **(self.async_fn_kwargs or {}))
        for fn in self.finalize_fns:
            fn()
        return result
