"""A blocking QMP client for the kernel tiers' QEMUs (tests/kernel/): connect once the socket
appears, negotiate capabilities, run commands, skip events."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any


class Qmp:
    def __init__(self, path: Path, deadline: float) -> None:
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.connect(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self.sock.close()
                assert time.monotonic() < deadline, "QEMU's QMP socket never appeared"
                time.sleep(0.2)
        self.file = self.sock.makefile("rw")
        assert "QMP" in json.loads(self.file.readline())
        assert "return" in self.cmd("qmp_capabilities")

    def cmd(self, name: str, **args: Any) -> dict[str, Any]:
        self.file.write(json.dumps({"execute": name, "arguments": args}) + "\n")
        self.file.flush()
        while True:
            reply: dict[str, Any] = json.loads(self.file.readline())
            if "event" not in reply:
                return reply

    def close(self) -> None:
        self.file.close()
        self.sock.close()
