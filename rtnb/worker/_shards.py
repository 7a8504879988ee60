"""A rank's dataset shards, watched: how long the rank has waited inside a shard's
``next()``, for the driver's data watch (a split dataset that another rank does not
read never answers: Ray Data's ``streaming_split`` streams only while every consumer
reads its part)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ShardWaits", "watched_shard"]

# The iterator makers of Ray Data's DataIterator: each epoch starts in one of them.
_ITERATING = ("iter_batches", "iter_rows", "iter_torch_batches", "iter_tf_batches")


class ShardWaits:
    """Which datasets this rank waits on now, since when (a monotonic clock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}

    def begin(self, name: str) -> bool:
        """The rank asks ``name``'s shard for its next item; False when an outer
        wrapper of the same call (``iter_torch_batches`` over ``iter_batches``)
        already counts it."""
        with self._lock:
            if name in self._since:
                return False
            self._since[name] = time.monotonic()
            return True

    def end(self, name: str) -> None:
        with self._lock:
            self._since.pop(name, None)

    def snapshot(self) -> dict[str, float]:
        """{dataset: seconds waited so far} for the waits in progress."""
        now = time.monotonic()
        with self._lock:
            return {name: round(now - since, 1) for name, since in self._since.items()}


def watched_shard(name: str, shard: Any, waits: ShardWaits) -> Any:
    """``shard`` itself (a Ray Data ``DataIterator``, so ``isinstance`` and every
    other method stay Ray's), its iterator makers wrapped to record waits."""
    for method in _ITERATING:
        inner = getattr(shard, method, None)
        if callable(inner):
            try:
                setattr(shard, method, _recording(name, inner, waits))
            except AttributeError:  # a shard class with __slots__: left unwatched
                return shard
    return shard


def _recording(name: str, make: Callable[..., Any], waits: ShardWaits) -> Callable[..., Any]:
    @functools.wraps(make)
    def iterate(*args: Any, **kwargs: Any) -> Any:
        return _recorded(make(*args, **kwargs), name, waits)

    return iterate


_RECORDING_CLASSES: dict[type, type] = {}


def _recorded(iterable: Any, name: str, waits: ShardWaits) -> Any:
    """``iterable`` itself, its class swapped for a subclass whose ``__iter__``
    records the waits: Ray's own type checks (``isinstance(x, _IterableFromIterator)``
    in its and rtnb's ``prepare_trainer``) and ``len()`` see what they saw. An object
    whose class cannot be swapped (a generator) is left unwatched."""
    base = type(iterable)
    recording = _RECORDING_CLASSES.get(base)
    if recording is None:

        def __iter__(self: Any) -> Iterator[Any]:
            items = base.__iter__(self)
            shard, shard_waits = self._rtnb_shard
            while True:
                counted = shard_waits.begin(shard)
                try:
                    item = next(items)
                except StopIteration:
                    return
                finally:
                    if counted:
                        shard_waits.end(shard)
                yield item

        recording = type(
            base.__name__, (base,), {"__iter__": __iter__, "__module__": base.__module__}
        )
        _RECORDING_CLASSES[base] = recording
    try:
        iterable._rtnb_shard = (name, waits)  # first: an object without a __dict__ stays as is
        iterable.__class__ = recording
    except (TypeError, AttributeError):
        return iterable
    return iterable
