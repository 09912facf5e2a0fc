"""``vmlend xml``: write and edit domain XML with remote devices (parsing only; the work is in
``vmlend.domain``)."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path, PurePath
from typing import Any

import click
from click.shell_completion import CompletionItem

from vmlend import safefile
from vmlend.cli.common import emit_action, emit_json, emit_table, json_option, read_input
from vmlend.cli.complete import complete_fdids
from vmlend.cli.context import CliContext
from vmlend.domain import (
    DeviceRequest,
    DomainDocument,
    DomainSpec,
    FdidValidator,
    PciAddress,
    TemplateSet,
    add_device,
    find_device,
    new_domain,
    remove_device,
)
from vmlend.domain.info import info_of
from vmlend.domain.ramcheck import require_computable_layout
from vmlend.domain.units import parse_cli_size
from vmlend.errors import ConfigError
from vmlend.messages import plural
from vmlend.topology.choose import choose
from vmlend.topology.model import InterruptPath, format_fdid, parse_fdid
from vmlend.topology.selectors import DeviceWish, parse_wish
from vmlend.units import format_size_exact

log = logging.getLogger(__name__)


class _Converting(click.ParamType[Any]):
    """A click type from one of our parse functions: its ConfigError becomes a usage error."""

    def __init__(self, name: str, parse: Any, complete: Any = None) -> None:
        self.name = name
        self._parse = parse
        self._complete = complete

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return self._parse(value)
        except (ConfigError, ValueError) as e:
            self.fail(str(e), param, ctx)

    def shell_complete(
        self, ctx: click.Context, param: click.Parameter, incomplete: str
    ) -> list[CompletionItem]:
        return list(self._complete(ctx, param, incomplete)) if self._complete else []


def _parse_device(text: str) -> DeviceRequest | DeviceWish:
    wish = parse_wish(text)
    if wish is not None:
        return wish
    fdid, _, addr = text.partition("@")
    return DeviceRequest(parse_fdid(fdid), PciAddress.parse(addr) if addr else None)


def _parse_uuid(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise ConfigError(f"bad UUID {text!r}") from None


FDID = _Converting("FDID", parse_fdid, complete_fdids)
DEVICE = _Converting("FDID[@ADDR]", _parse_device, complete_fdids)
ADDRESS = _Converting("DDDD:BB:SS.F", PciAddress.parse)
SIZE = _Converting("SIZE", parse_cli_size)
UUID = _Converting("UUID", _parse_uuid)
INTERRUPTS = click.Choice([p.value for p in InterruptPath])


def warn_unchecked(obj: CliContext) -> None:
    """After a successful write: say that the ids were not checked against a fabric."""
    why = (
        f"no state at {obj.state_path}"
        if not obj.state_path.exists()
        else "no fabric backend in this vmlend"
    )
    click.echo(
        f"vmlend: warning: {why}: device ids were checked for syntax only, not against a"
        " fabric (--state names one)",
        err=True,
    )


def fabric_validator(obj: CliContext) -> FdidValidator | None:
    """A check that an fdid exists in the fabric, when this host has a state to ask (None:
    syntax only; the caller warns with ``warn_unchecked`` once it has written)."""
    if obj.registry is None and not obj.state_path.exists():
        return None
    try:
        from vmlend.wiring.fabric import open_fabric
    except ImportError:
        return None
    fabric = open_fabric(obj.location, obj.node, backend=obj.backend, root=obj.root, observer=True)
    return fabric.device


def _read(path: Path) -> DomainDocument:
    return DomainDocument.parse(read_input(path), source=str(path))


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` so a reader never sees half a file; keeps its owner and permission
    bits (refusing, with nothing changed, when it cannot keep the owner). Root edits files in
    users' directories: ``vmlend.safefile`` never acts on a name a user can swap."""
    try:
        safefile.write_atomically(path, data, keep_owner=True)
    except PermissionError as e:
        if e.filename is None:  # fchown: the descriptor has no name
            raise ConfigError(
                f"cannot write {path} keeping its owner (run as that user or root);"
                " nothing was changed"
            ) from None
        raise ConfigError(f"cannot write {path}: {e.strerror}") from None
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror}") from None


@click.group("xml")
def xml_group() -> None:
    """Write and edit libvirt domain XML that uses remote devices."""


@xml_group.command("new")
@click.argument("name")
@click.option(
    "--memory",
    type=SIZE,
    default="1G",
    show_default=True,
    help="Guest RAM: MiB, or with a unit (4G, 4GiB; 4GB is decimal).",
)
@click.option("--vcpus", type=click.IntRange(1, 4096), default=1, show_default=True)
@click.option("--machine", type=click.Choice(["q35", "pc"]), default="q35", show_default=True)
@click.option(
    "--virt-type",
    type=click.Choice(["kvm", "qemu"]),
    default="kvm",
    show_default=True,
    help="kvm, or qemu for TCG (no /dev/kvm).",
)
@click.option(
    "--device",
    "devices",
    type=DEVICE,
    multiple=True,
    help="A remote device by fdid, optionally at a guest address (0x10, 0x10@0000:00:05.0), or"
    " chosen: by kind (gpu, gpu:2, nvme,lender=alpha), by vendor and product id"
    " (vendor=10de,product=1db4[,count=2]) or by an alias of the configuration file's [alias]"
    " table (a100:2); the available ones with the shortest path from this node are chosen."
    " Repeatable.",
)
@click.option(
    "--hotplug-slots",
    type=click.IntRange(0, 64),
    default=0,
    show_default=True,
    help="Free pcie-root-ports (q35) for devices hot-added later.",
)
@click.option(
    "--interrupts",
    type=INTERRUPTS,
    help="How the devices' MSI/MSI-X reach the VM (the VM's default): over the NTB when its"
    " window has room, else the relay; or always the relay [default: ntb].",
)
@click.option("--disk", type=click.Path(dir_okay=False), help="Boot disk image (qcow2 or raw).")
@click.option("--uuid", "domain_uuid", type=UUID, help="Domain UUID [default: random].")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    help="Write here, not stdout ('-': stdout, as other tools read it).",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --output file.")
@click.option("--no-fabric-check", is_flag=True, help="Do not ask the fabric about the fdids.")
@click.pass_obj
def new_cmd(
    obj: CliContext,
    name: str,
    memory: int,
    vcpus: int,
    machine: str,
    virt_type: str,
    devices: tuple[DeviceRequest | DeviceWish, ...],
    hotplug_slots: int,
    interrupts: str | None,
    disk: str | None,
    domain_uuid: uuid.UUID | None,
    output: str | None,
    force: bool,
    no_fabric_check: bool,
) -> None:
    """A complete domain XML for NAME, on stdout or in -o FILE."""
    if output == "-":
        output = None
    if output and Path(output).exists() and not force:
        raise click.UsageError(f"{output} exists; pass --force to overwrite it")
    chosen = _choose(obj, devices, no_fabric_check)
    spec = DomainSpec(
        name=name,
        memory_bytes=memory,
        vcpus=vcpus,
        machine=machine,
        virt_type=virt_type,
        uuid=domain_uuid,
        disk=PurePath(disk) if disk else None,
        devices=chosen,
        hotplug_slots=hotplug_slots,
        interrupts=None if interrupts is None else InterruptPath(interrupts),
    )
    validator = None if no_fabric_check or not chosen else fabric_validator(obj)
    doc = new_domain(spec, templates=TemplateSet(), validate_fdid=validator)
    if chosen:
        require_computable_layout(doc)
    data = doc.to_bytes()
    if output:
        write_atomically(Path(output), data)
        click.echo(f"wrote {output} ({plural(len(chosen), 'remote device')})", err=True)
    else:
        click.echo(data.decode(doc.encoding), nl=False)
    if chosen and not no_fabric_check and validator is None:
        warn_unchecked(obj)


def _choose(
    obj: CliContext, devices: tuple[DeviceRequest | DeviceWish, ...], no_fabric_check: bool
) -> tuple[DeviceRequest, ...]:
    """The fdids asked for, and devices chosen for each selector (said on stderr)."""
    named = tuple(d for d in devices if isinstance(d, DeviceRequest))
    wishes = [d for d in devices if isinstance(d, DeviceWish)]
    if not wishes:
        return named
    if no_fabric_check:
        raise click.UsageError(
            f"choosing a device ({wishes[0]}) asks the fabric: drop --no-fabric-check or name"
            " the fdids"
        )
    with obj.fabric() as f:
        picks = choose(
            f.topology(),
            f.devices(),
            wishes,
            f.local_node,
            exclude=[d.fdid for d in named],
            aliases=obj.aliases,
        )
        for c in picks:
            click.echo(f"chose {c.describe()}", err=True)
    return named + tuple(DeviceRequest(c.fdid) for c in picks)


@xml_group.command("add-device")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("fdid", type=FDID)
@click.option("--address", type=ADDRESS, help="Guest PCI address [default: libvirt picks].")
@click.option(
    "--interrupts",
    type=INTERRUPTS,
    help="How this device's MSI/MSI-X reach the VM: over the NTB when its window has room,"
    " else the relay; or always the relay [default: the VM's, else ntb].",
)
@click.option("--no-fabric-check", is_flag=True, help="Do not ask the fabric about the fdid.")
@json_option
@click.pass_obj
def add_device_cmd(
    obj: CliContext,
    file: Path,
    fdid: int,
    address: PciAddress | None,
    interrupts: str | None,
    no_fabric_check: bool,
    json_output: bool,
) -> None:
    """Add remote device FDID to the domain XML in FILE (in place). A device that is already
    there is left alone."""
    doc = _read(file)
    validator = None
    present = find_device(doc, fdid) is not None
    if not present:
        require_computable_layout(doc)
        validator = None if no_fabric_check else fabric_validator(obj)
        if validator is not None:
            validator(fdid)
    elif address is None and interrupts is None:
        click.echo(
            f"device {format_fdid(fdid)} is already in {file}; nothing was changed", err=True
        )
        if json_output:
            emit_action("unchanged", fdid=format_fdid(fdid), file=str(file))
        return
    irq = None if interrupts is None else InterruptPath(interrupts)
    changed = add_device(doc, fdid, templates=TemplateSet(), address=address, interrupts=irq)
    write_atomically(file, changed.to_bytes())
    if not no_fabric_check and validator is None:
        warn_unchecked(obj)
    if json_output:
        emit_action("unchanged" if present else "added", fdid=format_fdid(fdid), file=str(file))


@xml_group.command("remove-device")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("fdid", type=FDID)
@click.option("--missing-ok", is_flag=True, help="Succeed when the device is not there.")
@json_option
def remove_device_cmd(file: Path, fdid: int, missing_ok: bool, json_output: bool) -> None:
    """Remove remote device FDID from the domain XML in FILE (in place)."""
    doc = _read(file)
    if missing_ok and find_device(doc, fdid) is None:
        click.echo(f"device {format_fdid(fdid)} is not in {file}; nothing was changed", err=True)
        if json_output:
            emit_action("unchanged", fdid=format_fdid(fdid), file=str(file))
        return
    write_atomically(file, remove_device(doc, fdid).to_bytes())
    if json_output:
        emit_action("removed", fdid=format_fdid(fdid), file=str(file))


@xml_group.command("show")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@json_option
def show_cmd(file: Path, json_output: bool) -> None:
    """The remote devices of the domain XML in FILE, and any disagreement in it."""
    info = info_of(_read(file), strict=False)
    if json_output:
        emit_json(info.to_json())
    else:
        memory = format_size_exact(info.memory_bytes) if info.memory_bytes is not None else "?"
        click.echo(f"{info.name}  uuid {info.uuid}  {info.machine or '?'}  {memory}")
        rows = [
            (
                format_fdid(d.fdid),
                str(d.mdev),
                str(d.address) if d.address else "-",
                info.interrupts_of(d).value,
            )
            for d in info.devices
        ]
        emit_table(("FDID", "MDEV", "GUEST ADDRESS", "INTERRUPTS"), rows)
    for p in info.problems:
        click.echo(f"vmlend: warning: {p.message}", err=True)
    if info.problems:
        raise SystemExit(1)


COMMANDS = [xml_group]
