"""A rank's end of the open channel (the wire: ``core/_channel.py``).

The rank listens on its node's address; the kernel that drives the group connects
once, proves the key it handed over through Ray, and from then on sends each cell's
start and long-polls as frames. One thread serves the connection: the calls of one
rank come one at a time (the kernel keeps at most one in flight per rank), and each
is the actor's own ``run`` or ``poll``, so a call means the same on either path.
Control calls (stop, hold, debug, …) stay on Ray's calls: they must reach a rank
while its long-poll waits.
"""

from __future__ import annotations

import pickle
import socket
import threading
from collections.abc import Callable

from rtnb.core._channel import (
    ANSWER,
    FAILED,
    POLL,
    RUN,
    ChannelClosed,
    recv_frame,
    send_frame,
    set_fast,
    unpack_poll,
    verify_peer,
)

__all__ = ["ChannelServer"]

# A connection that has not answered the challenge by then is dropped.
_CHALLENGE_S = 10.0


class ChannelServer:
    """Serves ``run(request_bytes) -> update_bytes`` and ``poll(wait_s, batch_s) ->
    update_bytes`` to the one kernel that knows ``key``."""

    def __init__(
        self,
        run: Callable[[bytes], bytes],
        poll: Callable[[float, float], bytes],
        key: bytes,
    ) -> None:
        self._run, self._poll, self._key = run, poll, key
        self._listener: socket.socket | None = None

    def open(self, host: str) -> int:
        """Listen on ``host`` (the rank's node address); the port."""
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listener.bind((host, 0))
        listener.listen(4)
        self._listener = listener
        threading.Thread(target=self._accept, name="rtnb-channel", daemon=True).start()
        return int(listener.getsockname()[1])

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def _accept(self) -> None:
        while self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed with the rank
            with conn:
                try:
                    conn.settimeout(_CHALLENGE_S)
                    if not verify_peer(conn, self._key):
                        continue
                    conn.settimeout(None)
                    set_fast(conn)
                    self._serve(conn)
                except (ChannelClosed, OSError):
                    continue  # the kernel left: wait for the next one

    def _serve(self, conn: socket.socket) -> None:
        while True:
            number, body = recv_frame(conn)
            try:
                if body[:1] == RUN:
                    answer = ANSWER + self._run(body[1:])
                elif body[:1] == POLL:
                    answer = ANSWER + self._poll(*unpack_poll(body))
                else:
                    raise ValueError(f"an unknown channel call {body[:1]!r}")
            except Exception as exc:  # noqa: BLE001 - the kernel reports it as a lost call
                answer = FAILED + _pickled(exc)
            send_frame(conn, number, answer)


def _pickled(exc: Exception) -> bytes:
    try:
        return pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its line
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
