"""How long each registry call of a path may take, when that path may give up early.

A VM that stops during an etcd outage must not wait for every endpoint's timeout and the
gateway's retries: what its release cannot do is kept on the host and landed by the agent
(``vmlend.release_journal``). So the release path runs ``with each_call_within(...)``, and
the etcd gateway (``etcd_gateway.EtcdGateway.call``) ends each call of that thread within the
deadline, endpoints and retries included. Every other path, and every other thread, keeps the
gateway's own timeouts and retries. Nothing here imports the etcd client: an SQLite host's
hook loads this module and nothing more.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

#: The deadline of each registry call on the release path (the whole call: every endpoint and
#: retry in it). A healthy registry answers in milliseconds; one that has not answered by then
#: is unreachable as far as the release is concerned.
RELEASE_CALL_DEADLINE = 2.0

_EACH_CALL: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "vmlend_registry_each_call", default=None
)


@contextlib.contextmanager
def each_call_within(seconds: float) -> Iterator[None]:
    """Every registry call this thread makes inside the block ends within ``seconds`` of its
    start, every endpoint and retry in it: what it could not do by then is a
    ``RegistryUnreachableError``."""
    token = _EACH_CALL.set(seconds)
    try:
        yield
    finally:
        _EACH_CALL.reset(token)


def call_bound() -> float | None:
    """The deadline of each call of this thread, in seconds (None: the gateway's own)."""
    return _EACH_CALL.get()
