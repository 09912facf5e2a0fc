"""A client of the relay daemon's control socket, as a VMM (or the vmlend CLI) uses it."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from vmlend.errors import RelayError
from vmlend.irq.control import close_fds, recv_message, send_message
from vmlend.irq.vfio import DISABLE, TRIGGER_EVENTFDS, UNMASK_EVENTFD
from vmlend.safefile import socket_path_problem


class RelayClient:
    def __init__(self, socket_path: Path, timeout: float = 5.0) -> None:
        problem = socket_path_problem(socket_path)
        if problem is not None:
            raise RelayError(f"cannot reach the relay daemon: {problem}")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(socket_path))
        except OSError as e:
            self._sock.close()
            raise RelayError(
                f"cannot reach the relay daemon at {socket_path} ({e.strerror});"
                " start it with 'vmlend relay'"
            ) from None

    def request(self, msg: dict[str, Any], fds: Sequence[int] = ()) -> dict[str, Any]:
        try:
            send_message(self._sock, msg, fds)
            reply, extra = recv_message(self._sock)
        except TimeoutError:
            raise RelayError("the relay daemon did not answer in time") from None
        except OSError as e:
            raise RelayError(f"relay daemon connection failed: {e.strerror or e}") from None
        close_fds(extra)
        if reply is None:
            raise RelayError("the relay daemon closed the connection")
        if not reply.get("ok"):
            raise RelayError(f"relay daemon: {reply.get('error', 'unknown error')}")
        return reply

    def attach(self, devices: Sequence[int], transport: socket.socket) -> None:
        """Hand the daemon a transport end (the daemon gets its own copy; close yours)."""
        self.request({"op": "attach", "devices": list(devices)}, [transport.fileno()])

    def set_irqs(self, device: int, index: int, flags: int, start: int, fds: Sequence[int]) -> None:
        """VFIO_DEVICE_SET_IRQS. ``fds`` are descriptors (or -1 to de-assign); the daemon gets
        copies, so the caller keeps its own."""
        passed = [fd for fd in fds if fd >= 0]
        positions: list[int] = []
        n = 0
        for fd in fds:
            positions.append(n if fd >= 0 else -1)
            n += fd >= 0
        msg = {
            "op": "set_irqs",
            "device": device,
            "index": index,
            "flags": flags,
            "start": start,
            "count": len(positions),
            "fds": positions,
        }
        self.request(msg, passed)

    def set_triggers(self, device: int, index: int, fds: Sequence[int], start: int = 0) -> None:
        self.set_irqs(device, index, TRIGGER_EVENTFDS, start, fds)

    def set_resample(self, device: int, fd: int) -> None:
        self.set_irqs(device, 0, UNMASK_EVENTFD, 0, [fd])

    def disable(self, device: int, index: int) -> None:
        self.set_irqs(device, index, DISABLE, 0, [])

    def release(self, device: int) -> None:
        self.request({"op": "release", "device": device})

    def status(self) -> dict[str, Any]:
        return self.request({"op": "status"})

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> RelayClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
