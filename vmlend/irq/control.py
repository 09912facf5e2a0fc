"""The relay daemon's control protocol: one JSON object per SOCK_SEQPACKET message, descriptors
alongside as SCM_RIGHTS.

Requests (replies are ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``):
- ``{"op": "attach", "devices": [fdid, ...]}`` + one fd: the transport to those devices' lender.
- ``{"op": "set_irqs", "device": fdid, "index": i, "flags": f, "start": s, "count": n,
  "fds": [...]}``: VFIO_DEVICE_SET_IRQS; each of the ``n`` ``fds`` entries is -1 (de-assign)
  or the position of a passed fd.
- ``{"op": "release", "device": fdid}``: the device left this node (hot-remove, VM released).
- ``{"op": "status"}``: ``{"devices": [...]}``.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
from collections.abc import Sequence
from typing import Any

from vmlend.errors import RelayError

MAX_MESSAGE = 65536
MAX_FDS = 256


def send_message(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(msg).encode()
    if len(data) > MAX_MESSAGE:
        raise RelayError(f"control message of {len(data)} bytes is too long")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the fds that came with it; (None, []) at EOF. The caller owns the fds.

    Raises RelayError for a malformed message (after closing any fds received with it).
    """
    fds_size = array.array("i").itemsize * MAX_FDS
    data, ancdata, flags, _addr = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(fds_size))
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    if not data and not fds:
        return None, []
    try:
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            raise RelayError("control message truncated (too long or too many fds)")
        try:
            msg = json.loads(data)
        except ValueError as e:
            raise RelayError(f"control message is not JSON: {e}") from None
        if not isinstance(msg, dict):
            raise RelayError("control message must be a JSON object")
    except RelayError:
        close_fds(fds)
        raise
    return msg, fds


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
