"""A live migration in progress, as the registry shows it: what a destination's agent checks
a plug request against before it reserves or plugs anything (DESIGN, "Trust between hosts").

The source writes the record when the migration starts (``begin``) and deletes it when the
migration ends, done or rolled back (``end``); an interrupted run leaves it for the re-run,
and a source host that dies takes it with its lease. Its key is ``migrations/<VM UUID>``;
its value::

    {"version": 1, "vm": NAME, "vm_uuid": UUID, "source": NODE, "destination": NODE,
     "devices": {FDID: TOKEN, ...}}

``devices`` are the VM's remote devices with the fencing token of the hold the VM had on
each when the migration started (0: not known). A plug request names the same VM UUID,
source and destination and, for each device it asks for, the same token; a request that does
not (``refusal``) is answered with one line and nothing is reserved or plugged.
"""

from __future__ import annotations

import logging
from uuid import UUID

import msgspec

from vmlend.errors import StateError
from vmlend.registry.etcd_store import EtcdRegistry
from vmlend.registry.migrations import MigrationStore

log = logging.getLogger(__name__)

VERSION = 1
#: The largest record read (a VM has at most a few dozen remote devices).
MAX_RECORD_BYTES = 64 * 1024


class MigrationRecord(msgspec.Struct, frozen=True):
    """A live migration of VM ``vm`` (``vm_uuid``) from ``source`` to ``destination``."""

    vm: str
    vm_uuid: str
    source: str
    destination: str
    #: Each remote device's fdid and the fencing token of the VM's hold on it at the start.
    devices: dict[int, int]
    version: int = VERSION


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(MigrationRecord)


def canonical_uuid(text: str) -> str | None:
    """``text`` as a UUID's canonical form, or None when it is not one."""
    try:
        return str(UUID(text))
    except (ValueError, TypeError, AttributeError):
        return None


class MigrationRecords:
    """The live-migration records of one cluster registry."""

    def __init__(self, registry: EtcdRegistry) -> None:
        self.store = MigrationStore(registry)

    def begin(self, record: MigrationRecord) -> None:
        """Record ``record`` as in progress (replacing an earlier record of the VM)."""
        self.store.put(_key(record.vm_uuid), _encoder.encode(record))

    def end(self, record: MigrationRecord) -> bool:
        """Delete ``record`` if the registry still holds it; whether it did."""
        return self.store.drop(_key(record.vm_uuid), _encoder.encode(record))

    def read(self, vm_uuid: str) -> MigrationRecord | None:
        """The record of ``vm_uuid``; None when there is none. ``StateError`` (one line) when
        the value there is not a record."""
        key = canonical_uuid(vm_uuid)
        if key is None:
            return None
        raw = self.store.get(key)
        if raw is None:
            return None
        where = self.store.key(key).removeprefix(self.store.keys.base)
        if len(raw) > MAX_RECORD_BYTES:
            raise StateError(
                f"the live-migration record {where} is {len(raw)} bytes, over the limit of"
                f" {MAX_RECORD_BYTES}; it is no record vmlend wrote"
            )
        try:
            return _decoder.decode(raw)
        except msgspec.DecodeError as e:
            raise StateError(
                f"the live-migration record {where} is not one ({e}); it is no record vmlend"
                " wrote"
            ) from None


def _key(vm_uuid: str) -> str:
    key = canonical_uuid(vm_uuid)
    if key is None:
        raise StateError(f"{vm_uuid!r} is not a VM UUID")
    return key


def refusal(
    record: MigrationRecord | None,
    *,
    vm: str,
    vm_uuid: str,
    source: str,
    destination: str,
    tokens: dict[int, int],
) -> str | None:
    """Why a plug request for ``tokens``' devices (fdid: token) into VM ``vm`` (``vm_uuid``)
    from ``source`` on ``destination`` does not match ``record``, the registry's live
    migration of that VM (None: none in progress); None when it matches."""
    if record is None:
        return (
            f"no live migration of VM {vm_uuid} from {source} to {destination} is in progress"
            " in the registry; nothing was plugged"
        )
    theirs = (record.vm_uuid.lower(), record.source, record.destination, record.vm)
    if theirs != (vm_uuid.lower(), source, destination, vm):
        return (
            f"the registry's live migration of VM {record.vm_uuid} is {record.vm!r} from"
            f" {record.source} to {record.destination}, not {vm!r} from {source} to"
            f" {destination}; nothing was plugged"
        )
    for fdid, token in sorted(tokens.items()):
        if fdid not in record.devices:
            return (
                f"device {fdid:#x} is not one the live migration of VM {vm!r} moves;"
                " nothing was plugged"
            )
        if record.devices[fdid] != token:
            return (
                f"device {fdid:#x}: the request's hold token {token} is not the migration's"
                f" ({record.devices[fdid]}); nothing was plugged"
            )
    return None
