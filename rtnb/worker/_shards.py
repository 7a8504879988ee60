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
    def iterate(*args: Any, **kwargs: Any) -> Iterator[Any]:
        items = iter(make(*args, **kwargs))
        while True:
            counted = waits.begin(name)
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                if counted:
                    waits.end(name)
            yield item

    return iterate
