"""Records kept decoded by their stored form, for one open registry.

A reserve reads every claim on its path's adapters: about 45 on an empty fabric, 141 on a full
one, most of them unchanged since the last reserve. Decoding them again each time made a
reserve's cost grow with how full its adapters are (issue 38, point 3). The stored form (a
SQLite row, an etcd value) holds every field, so an equal form is an equal record, and a
changed or damaged one is a new key: decoded, or refused, as if nothing were kept.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")

#: A reserve reads a few hundred claims at most; this many (a few MB) cover the adapters of
#: the last fifty or so, where a full fabric of 16,384 devices holds ~100,000 claims.
DEFAULT_LIMIT = 1 << 14


class Decoded(Generic[_K, _V]):
    """What ``decode`` made of each stored form, at most ``limit`` of them (all forgotten at
    once past that: a registry that held more would only decode again). Shared by the threads
    of one registry: a lost race decodes twice, equal results."""

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._seen: dict[_K, _V] = {}
        self._limit = limit

    def __call__(self, stored: _K, decode: Callable[[_K], _V]) -> _V:
        got = self._seen.get(stored)
        if got is None:
            if len(self._seen) >= self._limit:
                self._seen.clear()
            got = self._seen[stored] = decode(stored)
        return got
