"""The interrupt vectors a held device has set up, as registry runtime records.

``vmlend status`` runs in another process than the relay, so what the relay wired is written
to the shared state (kind ``irq-vector``, one record per vector; they go with the hold)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vmlend.registry import Registry, StateTxn

RECORD_KIND = "irq-vector"

#: ``record(fdid, vectors)``: replace the device's vector records; ``None`` removes them.
VectorRecorder = Callable[[int, Sequence[dict[str, object]] | None], None]


def registry_vector_recorder(registry: Registry) -> VectorRecorder:
    def record(fdid: int, vectors: Sequence[dict[str, object]] | None) -> None:
        def body(tx: StateTxn) -> None:
            tx.clear_runtime(fdid, RECORD_KIND)
            for v in vectors or ():
                tx.put_runtime(fdid, RECORD_KIND, f"{v['mode']}.{v['vector']}", dict(v))

        registry.transact(body)

    return record
