"""A loopback TCP endpoint that accepts connections and never answers (a hung etcd member, or
one behind a blackhole), counting the connections made to it."""

from __future__ import annotations

import socket
import threading


class HungEndpoint:
    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.1)
        self.port = self._sock.getsockname()[1]
        self.connections = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _addr = self._sock.accept()
            except OSError:  # the accept timeout: look at the stop flag again
                continue
            self.connections += 1
            self._held.append(conn)  # read nothing, answer nothing

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for c in self._held:
            c.close()
        self._sock.close()
