"""Ask this host's agent whether it would serve the installed hook (``vmlend doctor``).

The probe is a real request for an operation the hook ignores (``started begin``, no XML), sent
with the environment the installed hook pins: the agent answers "not mine" or "denied" without
doing anything, or runs it, which touches nothing (the prefilter returns at once).
"""

from __future__ import annotations

import socket
from pathlib import Path

from vmlend.hook import wire

PROBE_ARGV = ["vmlend-doctor-probe", "started", "begin", "-"]


def probe_agent(path: Path, environ: dict[str, str], timeout: float = 5.0) -> str:
    """ "served", "not mine", "denied", or why nobody answered ("no socket", "refused",
    "permission denied", "not accepting", "no answer")."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except FileNotFoundError:
            return "no socket"
        except ConnectionRefusedError:
            return "refused"
        except PermissionError:
            return "permission denied"
        except OSError:  # a full backlog (EAGAIN) or a timeout: a listener that does not accept
            return "not accepting"
        try:
            sock.sendall(wire.encode_request(PROBE_ARGV, environ, b""))
            kind, _code, _out, _err = wire.decode_answer(wire.Reader(sock.recv))
        except (OSError, wire.WireError):
            return "no answer"
    finally:
        sock.close()
    return {wire.RAN: "served", wire.NOT_MINE: "not mine"}.get(kind, "denied")
