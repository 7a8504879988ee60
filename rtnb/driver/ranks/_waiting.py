"""Waiting on a Ray group's pending calls: Ray references, and calls on the open
channel (``ranks/_channel.py``) with the Ray calls that replace those that broke.
``WorkerGroup.take_ready`` is :func:`take_ready`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rtnb.core._messages import from_wire
from rtnb.driver.ranks._channel import ChannelCall, OpenChannel, fall_back

__all__ = ["take_ready"]

# Ranks in step answer a cell's calls within this of each other (see take_ready_ray).
_TOGETHER_S = 0.004
# Ray's calls beside the channel's are taken in turns of this long.
_TURN_S = 0.005


def take_ready(
    calls: list[Any],
    timeout_s: float,
    channel: OpenChannel | None,
    through_ray: Callable[[ChannelCall], Any],
) -> tuple[list[Any], list[Any]]:
    """Whatever ``calls`` are done within ``timeout_s``, with their results (a failed
    call's result is its exception; a rank's update as a
    :class:`~rtnb.core._messages.RankUpdate`), as soon as one is. Calls on the open
    channel are read there; one that broke is made again with ``through_ray`` and
    waited on as Ray's."""
    if channel is None or not any(isinstance(c, ChannelCall) for c in calls):
        return take_ready_ray(calls, timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        fall_back(calls, through_ray)
        on_channel = [c for c in calls if isinstance(c, ChannelCall) and c.fallback is None]
        by_ref = {
            (c.fallback if isinstance(c, ChannelCall) else c): c
            for c in calls
            if not (isinstance(c, ChannelCall) and c.fallback is None)
        }
        left = max(0.0, deadline - time.monotonic())
        if not by_ref:
            ready = channel.take_ready(on_channel, left)
            if ready or left <= 0 or not any(c.broken for c in on_channel):
                return ready, [c.answer for c in ready]
            continue  # a connection broke: its call goes to Ray
        # Ray's calls beside the channel's (a rank whose connection broke): take
        # turns in short waits (rare: a rank just died or lost its link).
        refs, answers = take_ready_ray(list(by_ref), 0.0 if on_channel else min(left, _TURN_S))
        ready = [by_ref[r] for r in refs]
        if on_channel:
            more = channel.take_ready(on_channel, 0.0 if ready else min(left, _TURN_S))
            ready += more
            answers += [c.answer for c in more]
        if ready or time.monotonic() >= deadline:
            return ready, answers


def take_ready_ray(calls: list[Any], timeout_s: float) -> tuple[list[Any], list[Any]]:
    """:func:`take_ready` for Ray's calls.

    One call in flight (the relay, or a single rank) is fetched with one
    ``ray.get``. With several, all are awaited for ``_TOGETHER_S`` first (ranks
    in step answer within that of each other: one wait and one get for the
    group), then the first ready one is taken with those ready by then: a
    ``ray.get`` of all of them held a rank's finished poll until the others'
    were ready too, up to a tick, so two ranks whose batches fell out of step
    (often for a whole cell) each waited for the other, and live reports
    arrived every ~300 ms instead of every 100 ms.
    """
    import ray

    if len(calls) == 1:
        try:
            return calls, [from_wire(r) for r in ray.get(calls, timeout=timeout_s)]
        except ray.exceptions.GetTimeoutError:
            return [], []
        except ray.exceptions.RayError:
            return calls, _get_each(ray, calls)
    together = min(timeout_s, _TOGETHER_S)
    try:
        return calls, [from_wire(r) for r in ray.get(calls, timeout=together)]
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
        pass  # some still running, or a rank is gone: take what is ready
    ready, rest = ray.wait(calls, num_returns=1, timeout=max(0.0, timeout_s - together))
    if ready and rest:
        more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
        ready += more
    return ready, _get_each(ray, ready)


def _get_each(ray: Any, refs: list) -> list:
    """Results of ``refs`` in one call when all succeed (the common, fast case); a
    failed ref (its rank died) yields its exception instead of losing the others."""
    if not refs:
        return []
    try:
        return [from_wire(r) for r in ray.get(refs)]
    except ray.exceptions.RayError:
        results = []
        for ref in refs:
            try:
                results.append(from_wire(ray.get(ref)))
            except ray.exceptions.RayError as exc:
                results.append(exc)
        return results
