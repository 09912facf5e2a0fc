"""What a registry's earlier commits knew, so that the next transaction can commit without
reading first (issue 38, point 5: a reserve+release cycle is four round trips; without the
reads it is two).

After a commit at revision C, every key the transaction compared held at C what it had read,
and every key it wrote holds what it wrote: both are known *at C*. A range it compared as a
prefix had nothing created or changed in it up to C but its own writes: its content is known
at C but for deletions by others (which only free things, see ``etcd_txn``). A range it read
loose (no compare) is known only at the revision it was read at; the transaction's own writes
are laid over it, and whatever guards a later decision on it compares from that revision.

A later attempt may take items from here instead of reading them (``Snapshot``): its compares
then name each item's own revision, so a commit succeeds only if nothing it decided on
changed since it was known, as with fresh reads. What does not commit (a refusal, a
read-only answer) is not checked by etcd, so ``EtcdRegistry.transact`` takes it only from
fresh reads; an attempt from remembered items that fails its compares clears everything
here (it was stale somewhere) and the next runs on fresh reads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping

from vmlend.registry.etcd_gateway import KeyValue

#: Keys and ranges kept at most: above it, what is known is dropped and learned again (an
#: agent's transactions touch a few hundred; a bound keeps a long run from growing).
LIMIT = 4096

#: A write as ``learn`` takes it: the value put (None: deleted) and the lease it went on.
Write = tuple[bytes | None, int]


def _prefixes_of(key: str) -> Iterator[str]:
    """``a/``, ``a/b/``, ... of key ``a/b/c``."""
    end = key.find("/")
    while end != -1:
        yield key[: end + 1]
        end = key.find("/", end + 1)


def reaches_into(deleted: Iterable[str], prefix: str) -> bool:
    """Some prefix of ``deleted`` holds a key of the range ``prefix``: one of the two starts
    with the other (under the range, or over it), so a key can start with both."""
    return any(d.startswith(prefix) or prefix.startswith(d) for d in deleted)


class WarmCache:
    """Keys and ranges known at a revision each, shared by a registry's transactions (and
    threads: every method holds the lock)."""

    def __init__(self, limit: int = LIMIT) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self._keys: dict[str, tuple[KeyValue | None, int]] = {}
        self._ranges: dict[str, tuple[dict[str, KeyValue], int]] = {}
        self._loose: dict[str, tuple[dict[str, KeyValue], int]] = {}

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._keys or self._ranges or self._loose)

    def key(self, key: str) -> tuple[KeyValue | None, int] | None:
        """The key's value (None: absent) and the revision it is known at, or None."""
        with self._lock:
            return self._keys.get(key)

    def range(self, prefix: str) -> tuple[dict[str, KeyValue], int] | None:
        """A compared range's keys and the revision they are known at, or None."""
        with self._lock:
            found = self._ranges.get(prefix)
            return None if found is None else (dict(found[0]), found[1])

    def loose(self, prefix: str) -> tuple[dict[str, KeyValue], int] | None:
        """A loose range's keys and the revision it was read at, or None."""
        with self._lock:
            found = self._loose.get(prefix)
            return None if found is None else (dict(found[0]), found[1])

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()
            self._ranges.clear()
            self._loose.clear()

    def learn(
        self,
        keys: Mapping[str, KeyValue | None],
        ranges: Iterable[tuple[str, dict[str, KeyValue]]],
        loose: Iterable[tuple[str, dict[str, KeyValue], int]],
        writes: Mapping[str, Write],
        deleted: Iterable[str],
        revision: int,
    ) -> None:
        """What a transaction that committed at ``revision`` knew: the ``keys`` it compared,
        the ``ranges`` it compared as prefixes, the ``loose`` ranges it read (with their read
        revision), and what it wrote (``writes``, and the prefixes it ``deleted``)."""
        deleted = list(deleted)

        def gone(key: str) -> bool:
            return any(key.startswith(p) for p in deleted)

        def after(key: str, before: KeyValue | None) -> KeyValue | None:
            if key not in writes:
                return None if gone(key) else before
            value, lease = writes[key]
            if value is None:
                return None
            # a put over an existing key keeps its creation revision (the fencing tokens
            # read it): known only for a key this transaction read
            created = before.create_revision if before is not None else revision
            return KeyValue(key, value, revision, created, lease)

        def overlaid(prefix: str, read: dict[str, KeyValue]) -> dict[str, KeyValue]:
            if reaches_into(deleted, prefix):
                keys = {*read, *(k for k in writes if k.startswith(prefix))}
                return {k: kv for k in keys if (kv := after(k, read.get(k))) is not None}
            # no deleted prefix reaches into this range: what was read stands but for the
            # keys written (a range holds hundreds of keys on a full adapter, a commit writes
            # a few)
            out = dict(read)
            for key in writes:
                if key.startswith(prefix):
                    kv = after(key, read.get(key))
                    if kv is None:
                        out.pop(key, None)
                    else:
                        out[key] = kv
            return out

        with self._lock:
            if self._size() > self._limit:
                self._keys.clear()
                self._ranges.clear()
                self._loose.clear()
            learned_keys = set(keys)
            learned_ranges: set[str] = set()
            learned_loose: set[str] = set()
            for key, kv in keys.items():
                self._keys[key] = (after(key, kv), revision)
            for prefix, read in ranges:
                self._ranges[prefix] = (overlaid(prefix, read), revision)
                learned_ranges.add(prefix)
            for prefix, read, read_at in loose:
                if prefix in learned_ranges:
                    continue
                self._loose[prefix] = (overlaid(prefix, read), read_at)
                learned_loose.add(prefix)
            # What this transaction wrote outside what it read: a remembered key it wrote
            # blind is dropped (its creation revision is not known); a remembered compared
            # range it wrote in is dropped (its compare would meet this very write); a
            # remembered loose range takes the write (it stays known at its read revision,
            # which is what its guards compare from).
            for key in writes:
                if key not in learned_keys:
                    self._keys.pop(key, None)
            if deleted:
                for key in [k for k in self._keys if k not in learned_keys and gone(k)]:
                    del self._keys[key]
            # the remembered ranges holding a written key, found by the key's own prefixes
            # (every range prefix ends in "/"): not a scan of every range per commit
            holding = {p for k in writes for p in _prefixes_of(k)}
            for prefix in holding & set(self._ranges) - learned_ranges:
                del self._ranges[prefix]
            for prefix in holding & set(self._loose) - learned_loose:
                read, read_at = self._loose[prefix]
                if read_at < revision:  # one read after it (another thread's) shows it
                    self._loose[prefix] = (overlaid(prefix, read), read_at)
            if deleted:  # ranges under or over a prefix deleted whole: forgotten
                learned = learned_ranges | learned_loose  # once, not per remembered range
                for cached in (self._ranges, self._loose):
                    for prefix in [
                        p for p in cached if p not in learned and reaches_into(deleted, p)
                    ]:
                        del cached[prefix]

    def _size(self) -> int:
        return len(self._keys) + len(self._ranges) + len(self._loose)
