"""Plug requests: the source of a live migration asks the destination's agent to plug the VM's
remote devices back in.

On the kernel backend a device's mdev exists in the sysfs of the host whose guest uses it, so
the re-plug of a live migration (``vmlend.ops.live_migrate``, step 5) must run on the
destination host. The source writes one request per migration into the cluster registry, under
``plugs/<destination node>/<VM UUID>`` (one per VM: a re-run replaces it). The destination's
``vmlend agent`` serves the requests of its node in its loop (``serve_plug_requests``): for a VM
running on its hypervisor it reserves each device, creates its mdev and hot-plugs it at its old
guest address (``vmlend.ops.attach``: the same checks and the same undo on failure), then writes
the outcome of every device into the request; a request for a VM that does not run there is
answered with every device failed. The source waits for the outcome (``plug_remotely``), reads
it and deletes the request: cleaned at the end, like the journal. An agent restarted in the
middle serves the request again from the start (a device already in the guest counts as
plugged); a source that gave up waiting deletes the request, and a re-run of ``migrate --live``
writes it again.

**Trust** (DESIGN, "Trust between hosts"): whoever may write the registry may write a plug
request, so the agent acts on one only when the registry shows that live migration in progress
(``vmlend.ops.migration_record``: the same VM UUID, source, destination and hold tokens), and
answers any other with a one-line refusal (``refused``), nothing reserved or plugged. A value
that is not a request (not JSON, not a request's shape, an impossible address, over
``MAX_PLUG_BYTES``) is removed with one log line; a request over ``MAX_PLUG_DEVICES`` is
refused. Neither stops the service: the next request is served.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from vmlend.errors import StateError, UnknownDomainError, VmlendError
from vmlend.fabric.base import Fabric
from vmlend.hypervisor import Hypervisor
from vmlend.messages import single_line
from vmlend.ops.attach import attach_live
from vmlend.ops.live_state import LiveDevice
from vmlend.ops.migration_record import MigrationRecords, refusal
from vmlend.ops.unplug import DetachWait
from vmlend.registry.etcd_store import EtcdRegistry
from vmlend.registry.plugs import PlugStore
from vmlend.topology.model import format_fdid

log = logging.getLogger(__name__)

Progress = Callable[[str], None]

#: The largest plug request the agent reads (one with 64 devices is about 10 KiB).
MAX_PLUG_BYTES = 64 * 1024
#: The most devices one plug request may name (a VM's remote devices; a PXH830-class adapter
#: lends at most 30 per node pair).
MAX_PLUG_DEVICES = 64


class PlugOutcome(msgspec.Struct, frozen=True):
    """What became of one device: plugged, or not and why."""

    fdid: int
    plugged: bool
    reason: str | None = None


class PlugRequest(msgspec.Struct):
    """Plug ``devices`` back into VM ``vm`` (``vm_uuid``) running on ``node``."""

    id: str
    vm: str
    vm_uuid: str
    node: str
    source: str
    devices: list[LiveDevice]
    #: The mdev UUID of each device (by fdid), as the destination derives it.
    mdevs: dict[int, str] = msgspec.field(default_factory=dict)
    #: The fencing token of the VM's hold on each device when the migration started (by
    #: fdid): the registry's record of the migration must say the same.
    tokens: dict[int, int] = msgspec.field(default_factory=dict)
    #: None until the destination's agent has served the request.
    outcome: list[PlugOutcome] | None = None
    #: Why the destination's agent refused the whole request (one line; ``outcome`` is then
    #: empty): it did not match a live migration in progress, or was over the bounds.
    refused: str | None = None

    @property
    def answered(self) -> bool:
        return self.outcome is not None or self.refused is not None


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(PlugRequest)


class Pending(msgspec.Struct, frozen=True):
    """One value under ``plugs/<node>/``: a request not answered yet, or one that is no
    request (``malformed`` says why)."""

    request_id: str
    mod_revision: int
    request: PlugRequest | None = None
    malformed: str | None = None


class PlugRequests:
    """The plug requests of one cluster registry, as ``PlugRequest`` values, and the live
    migrations in progress they are checked against."""

    def __init__(self, registry: EtcdRegistry) -> None:
        self.store = PlugStore(registry)
        self.migrations = MigrationRecords(registry)

    def agent_serves(self, node: str) -> bool:
        return self.store.agent_serves(node)

    def post(self, req: PlugRequest) -> None:
        """Write ``req`` (without an answer), replacing any earlier request for its VM."""
        req = msgspec.structs.replace(req, outcome=None, refused=None)
        self.store.put(req.node, req.id, _encoder.encode(req))

    def pending(self, node: str) -> list[Pending]:
        """The values under ``plugs/<node>/`` not answered yet: requests, and values that are
        no request (to be removed)."""
        out = []
        for request_id, value, rev in self.store.on(node):
            if len(value) > MAX_PLUG_BYTES:
                why = f"its value is {len(value)} bytes, over the limit of {MAX_PLUG_BYTES}"
                out.append(Pending(request_id, rev, malformed=why))
                continue
            try:
                req = _decoder.decode(value)
            except (msgspec.DecodeError, VmlendError) as e:  # not JSON, not a request's shape,
                # or a value its types refuse (a guest address out of range: ConfigError)
                out.append(Pending(request_id, rev, malformed=f"not a plug request ({e})"))
                continue
            if not req.answered:
                out.append(Pending(request_id, rev, request=req))
        return out

    def answer(self, node: str, request_id: str, req: PlugRequest, mod_revision: int) -> bool:
        """Write ``req`` (with its answer) at ``plugs/<node>/<request_id>`` unless the source
        replaced or deleted it since it was read (then: False, and the new one is served on
        the next pass)."""
        return self.store.replace(node, request_id, _encoder.encode(req), mod_revision)

    def remove(self, node: str, request_id: str, mod_revision: int) -> bool:
        """Delete the value at ``plugs/<node>/<request_id>`` unless it changed since read."""
        return self.store.drop_unchanged(node, request_id, mod_revision)

    def where(self, node: str, request_id: str) -> str:
        return self.store.where(node, request_id)

    def read(self, node: str, request_id: str) -> PlugRequest | None:
        """The request (None once deleted); ``StateError`` when the value there is none."""
        value = self.store.get(node, request_id)
        if value is None:
            return None
        try:
            if len(value) > MAX_PLUG_BYTES:
                raise msgspec.DecodeError(f"{len(value)} bytes, over {MAX_PLUG_BYTES}")
            return _decoder.decode(value)
        except (msgspec.DecodeError, VmlendError) as e:
            raise StateError(
                f"{self.where(node, request_id)} holds no plug request ({single_line(str(e))})"
            ) from None

    def drop(self, node: str, request_id: str) -> None:
        self.store.drop(node, request_id)


#: Seconds the source waits for the destination's agent by default.
DEFAULT_PLUG_TIMEOUT = 120.0


def serve_plug_request(
    hv: Hypervisor,
    fabric: Fabric,
    req: PlugRequest,
    *,
    wait: DetachWait | None = None,
    progress: Progress = lambda _m: None,
    plugged: Callable[[], None] = lambda: None,
) -> list[PlugOutcome]:
    """Plug ``req``'s devices into its VM on this host (``hv``, ``fabric``): what became of
    each (``plugged()`` after each device plugged). A VM that does not run here (or is
    another VM of the same name) gets nothing."""
    node = fabric.local_node
    refused = _refusal(hv, req, node)
    if refused is not None:
        return [PlugOutcome(d.fdid, False, refused) for d in req.devices]
    from vmlend.domain import read_domain

    present = {d.fdid for d in read_domain(hv.xml(req.vm), strict=False).devices}
    out = []
    for dev in req.devices:
        if dev.fdid in present:
            out.append(PlugOutcome(dev.fdid, True))  # an earlier (interrupted) run plugged it
            continue
        try:
            attach_live(
                hv,
                fabric,
                req.vm,
                dev.fdid,
                progress,
                address=dev.address,
                interrupts=dev.interrupts,
                wait=wait,
            )
        except VmlendError as e:
            out.append(PlugOutcome(dev.fdid, False, str(e)))
            continue
        plugged()
        out.append(PlugOutcome(dev.fdid, True))
    return out


def _refusal(hv: Hypervisor, req: PlugRequest, node: str) -> str | None:
    if req.node != node:
        return f"the request is for node {req.node}, not {node}"
    try:
        info = hv.lookup(req.vm)
    except UnknownDomainError:
        return f"VM {req.vm!r} is not on {node}"
    if not info.active:
        return f"VM {req.vm!r} is not running on {node}"
    if info.uuid.lower() != req.vm_uuid.lower():
        return f"VM {req.vm!r} on {node} is another VM (UUID {info.uuid}, not {req.vm_uuid})"
    return None


#: Plugs one request's devices and says what became of each (in the agent: on the VM's own
#: worker, ``vmlend.agent.guest.Guest.submit``).
Plugger = Callable[[PlugRequest], list[PlugOutcome]]


def plug_here(hv: Hypervisor, fabric: Fabric, wait: DetachWait | None = None) -> Plugger:
    """Plug a request's devices on this host's ``hv`` and ``fabric`` (``serve_plug_request``)."""

    def plug(req: PlugRequest) -> list[PlugOutcome]:
        return serve_plug_request(
            hv, fabric, req, wait=wait, progress=lambda m: log.info("plug request: %s", m)
        )

    return plug


def serve_plug_requests(requests: PlugRequests, node: str, plug: Plugger) -> list[PlugRequest]:
    """One pass of the agent: serve every pending request for ``node`` through ``plug`` that
    matches a live migration in progress (``check``), refuse the others, remove what is no
    request; the requests answered. Each value gets at most one log line."""
    served = []
    for entry in requests.pending(node):
        where = requests.where(node, entry.request_id)
        if entry.request is None:
            if requests.remove(node, entry.request_id, entry.mod_revision):
                log.warning("%s", single_line(f"removed {where}: {entry.malformed}"))
            continue
        req = entry.request
        refused = check(requests, req, node, entry.request_id)
        if refused is not None:
            answered = msgspec.structs.replace(req, outcome=[], refused=refused)
            if requests.answer(node, entry.request_id, answered, entry.mod_revision):
                served.append(answered)
                log.warning("%s", single_line(f"refused {where} (from {req.source}): {refused}"))
            continue
        log.info(
            "%s",
            single_line(
                f"plug request {req.id}: plugging {len(req.devices)} device(s) into {req.vm}"
            ),
        )
        try:
            outcome = plug(req)
        except Exception as e:  # the VM's worker ended, or the plug failed as a whole
            outcome = [PlugOutcome(d.fdid, False, str(e)) for d in req.devices]
        answered = msgspec.structs.replace(req, outcome=outcome)
        if requests.answer(node, entry.request_id, answered, entry.mod_revision):
            served.append(answered)
            for o in outcome:
                if not o.plugged:
                    log.warning(
                        "plug request %s: device %s: %s", req.id, format_fdid(o.fdid), o.reason
                    )
        else:
            log.warning("plug request %s was replaced or withdrawn while served", req.id)
    return served


def check(requests: PlugRequests, req: PlugRequest, node: str, request_id: str) -> str | None:
    """Why this agent (of ``node``) must not act on ``req``, read at ``plugs/<node>/
    <request_id>`` (one line), or None: it is within the bounds, names this node and its own
    key, and matches the registry's record of a live migration in progress."""
    if len(req.devices) > MAX_PLUG_DEVICES:
        return (
            f"the request names {len(req.devices)} devices, over the limit of"
            f" {MAX_PLUG_DEVICES}; nothing was plugged"
        )
    if len(req.mdevs) > MAX_PLUG_DEVICES or len(req.tokens) > MAX_PLUG_DEVICES:
        return f"the request is over the limit of {MAX_PLUG_DEVICES} devices; nothing was plugged"
    if req.node != node or req.id != request_id:
        return (
            f"the request names node {req.node!r} and id {req.id!r}, not those of its key"
            f" ({node!r}, {request_id!r}); nothing was plugged"
        )
    fdids = [d.fdid for d in req.devices]
    if len(set(fdids)) != len(fdids) or set(req.tokens) != set(fdids):
        return "the request does not give one hold token per device it names; nothing was plugged"
    try:
        record = requests.migrations.read(req.vm_uuid)
    except StateError as e:
        return f"{e}; nothing was plugged"
    return refusal(
        record,
        vm=req.vm,
        vm_uuid=req.vm_uuid,
        source=req.source,
        destination=node,
        tokens=req.tokens,
    )


def plug_remotely(
    requests: PlugRequests,
    req: PlugRequest,
    *,
    timeout: float,
    progress: Progress,
    interval: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[PlugOutcome]:
    """Ask ``req.node``'s agent to plug ``req``'s devices and wait up to ``timeout`` seconds for
    its answer; the outcome per device (the unanswered ones failed, with why). The request is
    gone afterwards either way."""
    if not requests.agent_serves(req.node):
        reason = (
            f"no vmlend agent with a hypervisor (-c) runs on {req.node} to plug them back;"
            " start it there"
        )
        return [PlugOutcome(d.fdid, False, reason) for d in req.devices]
    requests.post(req)
    progress(
        f"asked {req.node}'s agent to plug {len(req.devices)} device(s) back into {req.vm}:"
        f" waiting up to {timeout:g} s for it"
    )
    deadline = clock() + timeout
    said: set[str] = set()
    try:
        while True:
            try:
                got = requests.read(req.node, req.id)
            except StateError as e:
                if str(e) not in said:  # once per reason, not every interval
                    said.add(str(e))
                    log.warning("cannot read plug request %s yet: %s", req.id, e)
            else:
                if got is None:
                    reason = f"the plug request for {req.vm} on {req.node} was withdrawn"
                    return [PlugOutcome(d.fdid, False, reason) for d in req.devices]
                if got.refused is not None:
                    reason = f"{req.node}'s agent refused the request: {single_line(got.refused)}"
                    return [PlugOutcome(d.fdid, False, reason) for d in req.devices]
                if got.outcome is not None:
                    return got.outcome
            if clock() >= deadline:
                reason = (
                    f"{req.node}'s agent did not answer within {timeout:g} s (is 'vmlend agent'"
                    f" running on {req.node}?)"
                )
                return [PlugOutcome(d.fdid, False, reason) for d in req.devices]
            sleep(interval)
    finally:
        try:
            requests.drop(req.node, req.id)
        except StateError as e:
            log.warning("could not delete plug request %s: %s", req.id, e)
