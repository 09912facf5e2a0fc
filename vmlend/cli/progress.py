"""Progress for waits: a line when a wait starts (what for, and how long at most), and on a
terminal a live elapsed-time indicator, so nothing looks hung for more than a second."""

from __future__ import annotations

import sys
import threading
import time
from typing import IO

import click

_TICK = 0.5  # seconds between indicator updates


class Wait:
    """``with Wait("domain 'vm' to shut down", 60): ...`` around a blocking call."""

    def __init__(self, what: str, timeout: float, stream: IO[str] | None = None) -> None:
        self.what = what
        self.timeout = timeout
        self.stream = stream if stream is not None else sys.stderr
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0

    def _live(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def __enter__(self) -> Wait:
        click.echo(f"vmlend: waiting up to {self.timeout:g} s for {self.what}", err=True)
        self._started = time.monotonic()
        if self._live():
            self._thread = threading.Thread(target=self._tick, name="vmlend-wait", daemon=True)
            self._thread.start()
        return self

    def _tick(self) -> None:
        frames = "|/-\\"
        n = 0
        while not self._stop.wait(_TICK):
            elapsed = time.monotonic() - self._started
            self.stream.write(f"\r{frames[n % 4]} {elapsed:4.0f} s / {self.timeout:g} s ")
            self.stream.flush()
            n += 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.stream.write("\r\x1b[K")  # clear the indicator's line
            self.stream.flush()
