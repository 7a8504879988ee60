"""A rank's end of the open channel (the wire: ``core/_channel.py``).

The rank listens on its node's address; the kernel that drives the group connects
once, proves the key it handed over through Ray, and from then on sends each cell's
start and long-polls as frames. One thread serves each connection: the calls of one
rank come one at a time (the kernel keeps at most one in flight per rank), and each
is the actor's own ``run`` or ``poll``, so a call means the same on either path.

In a fanning group (``core/_channel.py``) rank 0 also connects to every other rank's
channel (:class:`Fanout`): a cell the kernel sends it once is started on all of
them, and their final updates come back in one answer; a rank with more to say is
asked directly by the kernel (the same token: nothing starts twice).
Control calls (stop, hold, debug, …) stay on Ray's calls: they must reach a rank
while its long-poll waits.
"""

from __future__ import annotations

import itertools
import pickle
import selectors
import socket
import threading
import time
from collections.abc import Callable

from rtnb.core._channel import (
    ANSWER,
    FAILED,
    FANOUT,
    POLL,
    RUN,
    START,
    ChannelClosed,
    connect_all,
    drop_connection,
    pack_start,
    recv_frame,
    send_frame,
    set_fast,
    unpack_fanout,
    unpack_poll,
    unpack_start,
    verify_peer,
)

__all__ = ["GIVE_WAY_S", "ChannelServer", "Fanout"]

# A connection that has not answered the challenge by then is dropped.
_CHALLENGE_S = 10.0
# How long rank 0 still waits for the others' answers to a cell it relays or fans
# out once its own has gone to the long-poll (the first points of a live plot wait
# this much longer at most).
GIVE_WAY_S = 0.05


class ChannelServer:
    """Serves ``run(request_bytes) -> update_bytes``, ``poll(wait_s, batch_s) ->
    update_bytes`` and ``start(request_bytes, wait_s) -> update_bytes | None`` to
    the processes that know ``key``: the kernel, and in a fanning group rank 0."""

    def __init__(
        self,
        run: Callable[[bytes], bytes],
        poll: Callable[[float, float], bytes],
        start: Callable[[bytes, float], bytes | None],
        key: bytes,
        rank: int,
    ) -> None:
        self._run, self._poll, self._start, self._key = run, poll, start, key
        self._rank = rank
        self._listener: socket.socket | None = None
        self._fanout: Fanout | None = None

    def open(self, host: str) -> int:
        """Listen on ``host`` (the rank's node address); the port."""
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listener.bind((host, 0))
        listener.listen(8)
        self._listener = listener
        threading.Thread(target=self._accept, name="rtnb-channel", daemon=True).start()
        return int(listener.getsockname()[1])

    def reach_peers(self, addresses: dict[int, tuple[str, int]], timeout_s: float) -> list[int]:
        """Rank 0: connect to the other ranks' channels (under the same key), for
        cells the kernel fans out through this rank; the ranks reached."""
        if self._fanout is not None:
            self._fanout.close()
        self._fanout = Fanout(connect_all(addresses, self._key, timeout_s))
        return self._fanout.ranks

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        fanout, self._fanout = self._fanout, None
        if fanout is not None:
            fanout.close()

    def _accept(self) -> None:
        # One thread per connection: the kernel's, and rank 0's in a fanning group
        # (a kernel that left, detached, is replaced by the next that attaches).
        while self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed with the rank
            threading.Thread(
                target=self._connected, args=(conn,), name="rtnb-channel-conn", daemon=True
            ).start()

    def _connected(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(_CHALLENGE_S)
                if not verify_peer(conn, self._key):
                    return
                conn.settimeout(None)
                set_fast(conn)
                self._serve(conn)
            except (ChannelClosed, OSError):
                return  # the other end left

    def _serve(self, conn: socket.socket) -> None:
        while True:
            number, body = recv_frame(conn)
            try:
                kind = body[:1]
                if kind == RUN:
                    answer = ANSWER + self._run(body[1:])
                elif kind == POLL:
                    answer = ANSWER + self._poll(*unpack_poll(body))
                elif kind == START:
                    wait_s, request = unpack_start(body)
                    answer = ANSWER + (self._start(request, wait_s) or b"")
                elif kind == FANOUT:
                    answer = ANSWER + self._fan_out(*unpack_fanout(body))
                else:
                    raise ValueError(f"an unknown channel call {kind!r}")
            except Exception as exc:  # noqa: BLE001 - the kernel reports it as a lost call
                answer = FAILED + _pickled(exc)
            send_frame(conn, number, answer)

    def _fan_out(self, wait_s: float, ranks: list[int], request: bytes) -> bytes:
        """Start the cell on ``ranks`` (the others first, then this rank's own) and
        gather their quick answers; pickled ``{rank: RankUpdate or None}``."""
        fanout = self._fanout
        others = [r for r in ranks if r != self._rank]
        sent = fanout.start(others, request, wait_s) if fanout is not None else None
        answers: dict[int, bytes | None] = dict.fromkeys(ranks)
        if self._rank in ranks:
            own = self._start(request, wait_s)
            answers[self._rank] = own
            if own is None:
                # This rank has output or reports to deliver, or a long cell: the
                # others get a moment more, not the whole wait.
                wait_s = min(wait_s, GIVE_WAY_S)
        if fanout is not None and sent is not None:
            answers.update(fanout.gather(sent, wait_s))
        # One pickle of every rank's update, not a pickle of each one's bytes: the
        # kernel unpickles the group's answer in half the time, which at 32 ranks
        # is most of what a trivial cell costs it beyond a 2-rank one.
        return pickle.dumps(
            {
                rank: None if answer is None else pickle.loads(answer)
                for rank, answer in answers.items()
            },
            protocol=pickle.HIGHEST_PROTOCOL,
        )


class Fanout:
    """Rank 0's connections to the other ranks' channels, by rank."""

    def __init__(self, socks: dict[int, socket.socket]) -> None:
        self._socks = socks
        self._numbers = itertools.count(1)
        self._selector = selectors.DefaultSelector()
        for rank, sock in socks.items():
            self._selector.register(sock, selectors.EVENT_READ, rank)

    @property
    def ranks(self) -> list[int]:
        return sorted(self._socks)

    def start(self, ranks: list[int], request: bytes, wait_s: float) -> tuple[int, set[int]]:
        """Send ``request`` to each of ``ranks`` reached: (the call's number, the
        ranks it went to)."""
        number, body, sent = next(self._numbers), pack_start(wait_s, request), set()
        for rank in ranks:
            sock = self._socks.get(rank)
            if sock is None:
                continue
            try:
                send_frame(sock, number, body)
            except ChannelClosed:
                self._drop(rank)
                continue
            sent.add(rank)
        return number, sent

    def gather(self, sent: tuple[int, set[int]], wait_s: float) -> dict[int, bytes | None]:
        """The answers to call ``sent`` that come within ``wait_s`` (an empty answer:
        the rank has more to deliver, or is still running). A late answer is read
        with a later call's and dropped by its number."""
        number, waiting = sent[0], set(sent[1])
        answers: dict[int, bytes | None] = {}
        deadline = time.monotonic() + wait_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in self._selector.select(left):
                rank = key.data
                try:
                    got, body = recv_frame(self._socks[rank])
                except (ChannelClosed, KeyError):
                    self._drop(rank)
                    waiting.discard(rank)
                    continue
                if got != number or rank not in waiting:
                    continue  # an earlier call's late answer
                waiting.discard(rank)
                answers[rank] = body[1:] if body[:1] == ANSWER and len(body) > 1 else None
        return answers

    def close(self) -> None:
        for rank in list(self._socks):
            self._drop(rank)
        self._selector.close()

    def _drop(self, rank: int) -> None:
        drop_connection(self._socks, self._selector, rank)


def _pickled(exc: Exception) -> bytes:
    try:
        return pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its line
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
