"""A TCP proxy between walberg and a server (the S3-compatible one, PostgreSQL), for tests of
what walberg does when the network fails or is slow."""

from __future__ import annotations

import re
import socket
import threading
import time
from typing import Optional

from conftest import free_port


class Proxy:
    """TCP between walberg and a server, cut and restored by the test. ``arm(pattern)`` cuts it
    when a request matching ``pattern`` goes through (that request is dropped). ``pace``: a slow
    link, what the server sends passed on in pieces of at most 16 kB, this many seconds apart."""

    def __init__(self, upstream: int, pace: float = 0.0) -> None:
        self.upstream = upstream
        self.pace = pace
        self.port = free_port()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._trigger: Optional[re.Pattern[bytes]] = None
        self.cuts = 0
        self.cut_at = 0.0
        self._listener: Optional[socket.socket] = None
        self.restore()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def arm(self, pattern: bytes) -> None:
        self._trigger = re.compile(pattern)

    def cut(self) -> None:
        with self._lock:
            self._trigger = None
            if self._listener is not None:
                self.cuts += 1
                self.cut_at = time.monotonic()
                _close(self._listener)
                self._listener = None
            for conn in list(self._conns):
                _close(conn)
            self._conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._conns.update((client, server))
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, outbound: bool) -> None:
        try:
            while True:
                data = src.recv(16384 if self.pace and not outbound else 65536)
                if not data:
                    break
                trigger = self._trigger
                if outbound and trigger is not None and trigger.search(data):
                    self.cut()
                    return
                dst.sendall(data)
                if self.pace and not outbound:
                    time.sleep(self.pace)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
