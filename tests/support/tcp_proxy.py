"""A loopback TCP proxy a test owns, to cut one host off from etcd and heal it again.

``cut()`` makes it a blackhole, as a silent partition is: connections stay open, nothing is
relayed in either direction and new connections are accepted but never forwarded, so the
client waits for its own timeout (no refusal, no reset). ``heal()`` relays again; connections
accepted while cut are forwarded from then on. ``latency``: seconds each chunk waits before it
is relayed, in either direction (a request and its answer: twice that on top).
"""

from __future__ import annotations

import select
import socket
import threading
import time


class TcpProxy:
    def __init__(self, upstream_port: int) -> None:
        self._upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self.latency = 0.0
        self._open = threading.Event()
        self._open.set()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._stop.set()
        self._open.set()
        self._threads[0].join(5)  # the acceptor first: it selects on the listener
        self._listener.close()
        with self._lock:
            for s in self._socks:
                s.close()
        for t in self._threads:
            t.join(5)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._listener], [], [], 0.1)
            except (OSError, ValueError):  # closed under it: the proxy is going away
                return
            if not ready or self._stop.is_set():
                continue
            try:
                client, _addr = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._relay, args=(client,), daemon=True)
            self._threads.append(t)
            t.start()

    def _relay(self, client: socket.socket) -> None:
        with self._lock:
            self._socks.append(client)
        self._open.wait()  # accepted while cut: held, unanswered
        if self._stop.is_set():
            return
        try:
            upstream = socket.create_connection(self._upstream, timeout=5)
        except OSError:
            client.close()
            return
        with self._lock:
            self._socks.append(upstream)
        pair = {client: upstream, upstream: client}
        try:
            while not self._stop.is_set():
                if not self._open.is_set():  # cut: leave the bytes where they are
                    self._open.wait(0.1)
                    continue
                ready, _, _ = select.select(list(pair), [], [], 0.1)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if self.latency:
                        time.sleep(self.latency)
                    pair[s].sendall(data)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()
