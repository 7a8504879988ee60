"""The open channel's wire: framed messages over one TCP connection per rank, opened
with a key the kernel handed the rank through Ray.

A cell's start and its long-polls cross this connection instead of Ray's actor calls
(see ``driver/ranks/_channel.py`` and ``worker/_channel.py``): an authenticated Ray
call costs the kernel's process ~0.2 ms of CPU and a round trip through the raylet;
a frame on a socket that stays open costs tens of microseconds.

A frame is a 4-byte length, the call's 8-byte number and its body. The connection is
only trusted after an HMAC challenge: the rank sends a random nonce, the kernel
answers with its HMAC under the key, so nothing that merely reaches the port can
run code on a rank, and the key itself never crosses the socket.

In a group of ``FANOUT_FROM_RANKS`` ranks and more, rank 0 also holds a connection
to every other rank (under the same key): the kernel sends a cell once, as
``FANOUT``, and rank 0 starts it on the others (``START``) and brings their quick
answers back in one frame, so the kernel's work for a cell stays flat in the ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import selectors
import socket
import struct
import time

__all__ = [
    "CHANNEL_ENV",
    "FANOUT",
    "FANOUT_FROM_RANKS",
    "START",
    "ChannelClosed",
    "POLL",
    "RUN",
    "answer_challenge",
    "channel_wanted",
    "connect_all",
    "drop_connection",
    "pack_fanout",
    "pack_poll",
    "pack_start",
    "recv_frame",
    "send_frame",
    "set_fast",
    "unpack_fanout",
    "unpack_poll",
    "unpack_start",
    "verify_peer",
]

# The environment variable that turns the open channel off (0): every call then
# goes through Ray, as through a Ray Client, where the kernel may not reach the nodes.
CHANNEL_ENV = "RTNB_OPEN_CHANNEL"

RUN = b"R"  # body: a pickled CellRequest (``to_wire``)
POLL = b"P"  # body: the long-poll's hold and batching window
START = b"S"  # body: the wait and a pickled CellRequest (rank 0 to another rank)
FANOUT = b"F"  # body: the wait, the ranks and a pickled CellRequest (kernel to rank 0)
ANSWER = b"U"  # body: a pickled RankUpdate (to START: one, or nothing; to FANOUT:
#                 a pickled dict of each rank's answer to START)
FAILED = b"E"  # body: the pickled exception the call raised

_HEAD = struct.Struct("<IQ")
_POLL = struct.Struct("<dd")
_WAIT = struct.Struct("<d")
_COUNT = struct.Struct("<H")
_NONCE_BYTES = 32
_MAX_FRAME = 1 << 31

# From this many ranks on the channel, cells fan out through rank 0: below it the
# extra hop costs a cell's wall time about what it saves the kernel's CPU. Measured
# on 2 cores, trivial cells alternating between groups of the same size
# (``benchmarks/relay.py``, 3 rounds): fanned out, the wall time 0.97-1.03x and the
# kernel's CPU 0.73-0.83x at 4 ranks, 1.04-1.07x and 0.69x at 8, 0.89-1.02x and
# 0.54x at 16.
FANOUT_FROM_RANKS = 16


class ChannelClosed(Exception):
    """The connection ended (the other process died, or the link was cut)."""


def channel_wanted() -> bool:
    return os.environ.get(CHANNEL_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def set_fast(sock: socket.socket) -> None:
    # Small frames, one answer per request: Nagle's delay would hold each one.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def send_frame(sock: socket.socket, number: int, body: bytes) -> None:
    try:
        sock.sendall(_HEAD.pack(len(body), number) + body)
    except OSError as exc:
        raise ChannelClosed(str(exc)) from None


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        try:
            n = sock.recv_into(view[got:])
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None
        if n == 0:
            raise ChannelClosed("the connection was closed")
        got += n
    return bytes(data)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    """The next frame: (the call's number, its body)."""
    size, number = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    if size >= _MAX_FRAME:
        raise ChannelClosed("a frame larger than the channel allows")
    return number, _recv_exact(sock, size) if size else b""


def pack_poll(wait_s: float, batch_s: float) -> bytes:
    return POLL + _POLL.pack(wait_s, batch_s)


def unpack_poll(body: bytes) -> tuple[float, float]:
    wait_s, batch_s = _POLL.unpack(body[1:])
    return wait_s, batch_s


def pack_start(wait_s: float, request: bytes) -> bytes:
    return START + _WAIT.pack(wait_s) + request


def unpack_start(body: bytes) -> tuple[float, bytes]:
    (wait_s,) = _WAIT.unpack_from(body, 1)
    return wait_s, body[1 + _WAIT.size :]


def pack_fanout(wait_s: float, ranks: list[int], request: bytes) -> bytes:
    count = _COUNT.pack(len(ranks))
    return FANOUT + _WAIT.pack(wait_s) + count + struct.pack(f"<{len(ranks)}H", *ranks) + request


def unpack_fanout(body: bytes) -> tuple[float, list[int], bytes]:
    (wait_s,) = _WAIT.unpack_from(body, 1)
    at = 1 + _WAIT.size
    (count,) = _COUNT.unpack_from(body, at)
    at += _COUNT.size
    ranks = list(struct.unpack_from(f"<{count}H", body, at))
    return wait_s, ranks, body[at + 2 * count :]


def connect_all(
    addresses: dict[int, tuple[str, int]], key: bytes, timeout_s: float
) -> dict[int, socket.socket]:
    """A proven connection to each rank at its ``(host, port)``; the ranks not
    reached within ``timeout_s`` (all of them together) are left out."""
    deadline = time.monotonic() + timeout_s
    socks: dict[int, socket.socket] = {}
    for rank, (host, port) in addresses.items():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            sock = socket.create_connection((host, port), timeout=left)
        except OSError:
            continue
        try:
            answer_challenge(sock, key)
        except (ChannelClosed, OSError):
            sock.close()
            continue
        sock.settimeout(None)
        set_fast(sock)
        socks[rank] = sock
    return socks


def drop_connection(
    socks: dict[int, socket.socket], selector: selectors.BaseSelector, rank: int
) -> None:
    """Close ``rank``'s connection of ``socks`` and stop watching it in ``selector``."""
    sock = socks.pop(rank, None)
    if sock is None:
        return
    with contextlib.suppress(KeyError, ValueError):
        selector.unregister(sock)
    sock.close()


def _mac(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, nonce, hashlib.sha256).digest()


def verify_peer(sock: socket.socket, key: bytes) -> bool:
    """The rank's side: challenge a new connection; True when it proved the key."""
    nonce = os.urandom(_NONCE_BYTES)
    send_frame(sock, 0, nonce)
    _, proof = recv_frame(sock)
    ok = hmac.compare_digest(proof, _mac(key, nonce))
    send_frame(sock, 0, b"ok" if ok else b"no")
    return ok


def answer_challenge(sock: socket.socket, key: bytes) -> None:
    """The kernel's side: prove the key; ChannelClosed when the rank refused it."""
    _, nonce = recv_frame(sock)
    send_frame(sock, 0, _mac(key, nonce))
    _, verdict = recv_frame(sock)
    if verdict != b"ok":
        raise ChannelClosed("the rank refused the channel's key")
