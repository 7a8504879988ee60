"""A slow link to object storage: a TCP proxy in front of a real S3 server whose
uploads crawl while the test holds it.

Each request's first ``free_bytes`` pass at once (headers, manifests, metrics
chunks), the rest of its body at ``crawl_bps`` while held: a checkpoint's PUT stays
in flight as long as the test likes, yet never stalls long enough for the S3
client's low-speed timeout to give up. Released, everything flows at once.
"""

from __future__ import annotations

import socket
import threading
import time


class SlowLink:
    def __init__(self, target: tuple[str, int], free_bytes: int = 64 * 1024, crawl_bps: int = 4096):
        self.target = target
        self.free_bytes = free_bytes
        self.crawl_bps = crawl_bps
        self._held = threading.Event()
        self._closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.crawling = threading.Event()  # set once a held upload crawled
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self._held.set()

    def release(self) -> None:
        self._held.clear()

    def close(self) -> None:
        self._closed.set()
        self._held.clear()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            # Bytes of the current request sent upstream since the server last answered.
            state = {"request": 0}
            threading.Thread(target=self._up, args=(client, server, state), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, state), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket, state: dict) -> None:
        piece = max(1, self.crawl_bps // 8)
        try:
            while data := src.recv(65536):
                while data:
                    if self._held.is_set() and state["request"] >= self.free_bytes:
                        self.crawling.set()
                        chunk, data = data[:piece], data[piece:]
                        dst.sendall(chunk)
                        time.sleep(len(chunk) / self.crawl_bps)
                    else:
                        room = (
                            max(1, self.free_bytes - state["request"])
                            if self._held.is_set()
                            else len(data)
                        )
                        chunk, data = data[:room], data[room:]
                        dst.sendall(chunk)
                    state["request"] += len(chunk)
        except OSError:
            pass
        finally:
            _close(src, dst)

    def _down(self, src: socket.socket, dst: socket.socket, state: dict) -> None:
        try:
            while data := src.recv(65536):
                state["request"] = 0  # the server answered: the next bytes up are a new request
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src, dst)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
