"""The kernel's end of the open channel (the wire: ``core/_channel.py``).

A group opens one connection to each rank when it starts and keeps it for its life:
a cell's start and its long-polls go over it as frames, so a trivial cell costs the
kernel a send and a read per rank instead of a Ray actor call each. What it cannot
carry falls back to Ray's calls on its own:

- a rank the kernel cannot reach (a Ray Client, a firewall, ``RTNB_OPEN_CHANNEL=0``)
  never gets a connection, and its calls are Ray's from the start;
- a connection that breaks (the rank's process died, the link was cut) marks its
  call *broken*: the group then makes the same call through Ray, which answers it
  if the rank lives (a cell started under a token is not started twice) and names
  how the rank died if not, in Ray's own words.

In a group of ``FANOUT_FROM_RANKS`` ranks and more whose every rank is reached, a
cell goes to rank 0 alone (:meth:`OpenChannel.fan_out`), which starts it on the
others and answers for all of them in one frame.

Each call carries a number the rank sends back with its answer: a call the kernel
let go (a Ctrl-C between a send and its read) has its late answer dropped instead
of being taken for the next call's.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import selectors
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from rtnb.core._channel import (
    ANSWER,
    RUN,
    ChannelClosed,
    connect_all,
    drop_connection,
    pack_fanout,
    pack_poll,
    recv_frame,
    send_frame,
)
from rtnb.core._messages import RankUpdate, from_wire

__all__ = ["ChannelCall", "OpenChannel", "channel_key"]

# Ranks in step answer a cell's calls within this of each other: once one answered,
# the others' answers are read as long as one comes within it (up to the most), so
# a cell's updates reach its handle in a few batches instead of one by one (each
# take costs the cell's driving loop a tick: at 32 ranks, 18 ticks a trivial cell).
_TOGETHER_S = 0.0005
_TOGETHER_MAX_S = 0.004
# How long the whole connect (every rank) may take before the ranks not reached
# keep Ray's calls: a reachable rank answers in a millisecond.
CONNECT_S = 2.0


def channel_key() -> bytes:
    return os.urandom(32)


class ChannelCall:
    """A call in flight on the channel (a *pending call* of the group)."""

    __slots__ = ("answer", "broken", "fallback", "fans_out", "number", "rank", "request")

    def __init__(
        self, rank: int, number: int, request: bytes | None, fans_out: bool = False
    ) -> None:
        self.rank, self.number = rank, number
        self.request = request  # a run's pickled request (its fallback is the same run)
        # A cell fanned out through rank 0: if its connection breaks, the call is
        # answered with the break (every rank is then asked directly), not remade.
        self.fans_out = fans_out
        self.answer: Any = None
        self.broken = False  # the connection broke before the answer came
        self.fallback: Any = None  # the same call made through Ray, once broken

    @property
    def done(self) -> bool:
        return self.answer is not None


class OpenChannel:
    """The connections of one group, by rank (a rank without one is not here)."""

    def __init__(self, socks: dict[int, socket.socket]) -> None:
        self._socks = socks
        self._selector = selectors.DefaultSelector()
        for rank, sock in socks.items():
            self._selector.register(sock, selectors.EVENT_READ, rank)
        self._numbers = itertools.count(1)
        self._closed = False
        # Closing the selector does not wake a thread waiting in it: a byte here does.
        self._wake, self._waker = socket.socketpair()
        self._selector.register(self._wake, selectors.EVENT_READ, None)
        # Per rank, its call in flight: the one whose answer is read next.
        self._live: dict[int, ChannelCall] = {}

    @classmethod
    def connect(
        cls, addresses: dict[int, tuple[str, int]], key: bytes, timeout_s: float = CONNECT_S
    ) -> OpenChannel:
        """Connect to each rank at its ``(host, port)`` and prove ``key``; the ranks
        not reached within ``timeout_s`` are left out (their calls stay Ray's)."""
        return cls(connect_all(addresses, key, timeout_s))

    @property
    def ranks(self) -> list[int]:
        return sorted(self._socks)

    def has(self, rank: int) -> bool:
        return rank in self._socks

    def close(self) -> None:
        """Close every connection (the group is shut down): a call still in flight,
        or made later, is answered with :class:`ChannelClosed` (its rank is gone
        with the group), never made again through Ray."""
        self._closed = True
        for call in self._live.values():
            call.answer = ChannelClosed("the worker group was shut down")
        self._live.clear()
        with contextlib.suppress(OSError):
            self._waker.send(b"x")
        for rank in list(self._socks):
            self._drop(rank)
        self._selector.close()
        self._waker.close()

    # ---- calls -------------------------------------------------------------------------
    def run(self, rank: int, request: bytes) -> ChannelCall:
        return self._send(rank, RUN + request, request)

    def poll(self, rank: int, wait_s: float, batch_s: float) -> ChannelCall:
        return self._send(rank, pack_poll(wait_s, batch_s), None)

    def fan_out(self, request: bytes, ranks: list[int], wait_s: float) -> ChannelCall:
        """Rank 0 starts ``request`` on ``ranks`` and answers with each one's final
        update (None: still running, or nothing heard; ask that rank directly)."""
        return self._send(0, pack_fanout(wait_s, ranks, request), None, fans_out=True)

    def _send(
        self, rank: int, body: bytes, request: bytes | None, fans_out: bool = False
    ) -> ChannelCall:
        # A call sent while an earlier one is unread: the earlier one was let go
        # (its answer, when it comes, matches no call and is dropped).
        call = ChannelCall(rank, next(self._numbers), request, fans_out)
        if self._closed:
            call.answer = ChannelClosed("the worker group was shut down")
            return call
        self._live[rank] = call
        try:
            send_frame(self._socks[rank], call.number, body)
        except (ChannelClosed, KeyError):
            self._break(rank)
        return call

    # ---- answers -----------------------------------------------------------------------
    def take_ready(self, calls: list[ChannelCall], timeout_s: float) -> list[ChannelCall]:
        """The calls of ``calls`` answered within ``timeout_s`` (``call.answer``: a
        :class:`RankUpdate`, or the exception the rank's call raised), returned as
        soon as one is, or as soon as one broke (``call.broken``; not returned)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._closed:
                for call in calls:
                    if not call.done and not call.broken:
                        call.answer = ChannelClosed("the worker group was shut down")
            done = [c for c in calls if c.done]
            if any(c.broken for c in calls):
                return done
            if done:
                if len(done) < len(calls) and self._more(_TOGETHER_S, _TOGETHER_MAX_S):
                    done = [c for c in calls if c.done]
                return done
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            self._more(left, left)

    def _more(self, wait_s: float, most_s: float) -> bool:
        """Read what arrives, until nothing has for ``wait_s`` (at most ``most_s`` in
        all); whether anything did. A rank outside the caller's calls is read too,
        so that its socket does not wake every select: its answer waits in its call."""
        end, got = time.monotonic() + most_s, False
        while True:
            try:
                ready = self._selector.select(min(wait_s, max(0.0, end - time.monotonic())))
            except (OSError, ValueError):
                return True  # closed from another thread: its calls are answered
            if not ready:
                return got
            for key, _ in ready:
                if key.data is None:
                    return True  # closed: its calls are answered
                self._read(key.data)
            got = True
            if time.monotonic() >= end or not self._live:
                return got

    def _read(self, rank: int) -> None:
        try:
            number, body = recv_frame(self._socks[rank])
        except (ChannelClosed, KeyError):
            self._break(rank)
            return
        call = self._live.get(rank)
        if call is None or call.number != number:
            return  # a call the kernel let go
        del self._live[rank]
        call.answer = _answer(body)

    def _break(self, rank: int) -> None:
        call = self._live.pop(rank, None)
        if call is not None and call.fans_out:
            call.answer = ChannelClosed("rank 0's channel broke")
        elif call is not None:
            call.broken = True
        self._drop(rank)

    def _drop(self, rank: int) -> None:
        drop_connection(self._socks, self._selector, rank)


def _answer(body: bytes) -> RankUpdate | BaseException:
    if body[:1] == ANSWER:
        return from_wire(body[1:])
    try:
        exc = pickle.loads(body[1:])
    except Exception as unpickled:  # noqa: BLE001
        return RuntimeError(f"the rank's answer could not be read: {unpickled}")
    return exc if isinstance(exc, BaseException) else RuntimeError(str(exc))


def fall_back(calls: Iterable[Any], make: Callable[[ChannelCall], Any]) -> None:
    """Give each broken channel call of ``calls`` its Ray call (``make``), once."""
    for call in calls:
        if isinstance(call, ChannelCall) and call.broken and call.fallback is None:
            call.fallback = make(call)
