"""Library warnings go to the hook's action log: libvirt shows the hook's stderr, which must
stay one line (the reason of a failure)."""

from __future__ import annotations

import logging

from vmlend.hook.actionlog import ActionLog


class ActionLogHandler(logging.Handler):
    def __init__(self, actions: ActionLog, domain: str) -> None:
        super().__init__(logging.WARNING)
        self.actions = actions
        self.domain = domain

    def emit(self, record: logging.LogRecord) -> None:
        self.actions.record(self.domain, record.levelname.lower(), record.getMessage())
