"""Trouble said once: a step that fails on every turn while etcd is away (a renewal, the fence
scan, the plug requests) logs its failure when it starts or changes, and one line when it
works again, not a line per turn."""

from __future__ import annotations

import logging


class Trouble:
    def __init__(self, log: logging.Logger, what: str, level: int = logging.INFO) -> None:
        self._log = log
        self._what = what
        self._level = level
        self._said = ""
        #: Failures since the step last worked.
        self.count = 0

    def failed(self, why: object) -> None:
        self.count += 1
        text = str(why)
        if text != self._said:
            self._said = text
            self._log.log(self._level, "%s: %s", self._what, text)

    def cleared(self) -> None:
        if self.count:
            self._log.info("%s: works again (after %d failure(s))", self._what, self.count)
        self._said, self.count = "", 0
