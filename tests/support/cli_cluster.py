"""Helpers for the attach/detach, migrate and status CLI tests: a simulated cluster in a real
state file, simulated hypervisor nodes that run the real vmlend hook as a subprocess, and the
``vmlend`` CLI through click's CliRunner. No tests here; conftest registers it as a plugin for the
``cluster`` fixture."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from lxml import etree

from tests.support.simfabric import make_fabric
from vmlend.cli import main
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
from vmlend.errors import DomainDefinitionError
from vmlend.sim.backend import SimFabric
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.topology.model import MiB
from vmlend.wiring.fabric import open_fabric
from vmlend.wiring.hypervisor import hook_command, open_hypervisor

TEMPLATES = TemplateSet()


@dataclass
class SimCluster:
    state_path: Path
    node: str = "gamma"  # the node fabric views default to

    def hv(self, node: str, **kw: object) -> SimHypervisor:
        hv = open_hypervisor(
            f"sim:///{node}",
            state_dir=self.state_path.parent,
            hook_command=hook_command(self.state_path, node),
        )
        assert isinstance(hv, SimHypervisor)
        for k, v in kw.items():
            setattr(hv, k, v)
        return hv

    def define(
        self,
        node: str,
        name: str,
        fdids: Sequence[int] = (),
        *,
        memory: int = 512 * MiB,
        running: bool = False,
        vm_uuid: uuid.UUID | None = None,
    ) -> bytes:
        spec = DomainSpec(
            name=name,
            memory_bytes=memory,
            virt_type="qemu",
            uuid=vm_uuid or uuid.uuid4(),
            devices=[DeviceRequest(f) for f in fdids],
        )
        xml = new_domain(spec, templates=TEMPLATES).to_bytes()
        hv = self.hv(node)
        hv.define(xml)
        if running:
            hv.start(name)
        return xml

    def cli(self, *args: str) -> Result:
        return CliRunner().invoke(main, ["--state", str(self.state_path), *args])

    def fabric(self, node: str | None = None) -> SimFabric:
        f = open_fabric(self.state_path, node or self.node)
        assert isinstance(f, SimFabric)
        return f

    def holds(self) -> dict[int, str]:
        with self.fabric() as f:
            return {d.fdid: str(d.holder) for d in f.devices() if d.holder}

    def states(self) -> dict[int, str]:
        with self.fabric() as f:
            return {d.fdid: d.state.value for d in f.devices()}

    def mdevs(self, node: str | None = None) -> set[tuple[str, int | None]]:
        with self.fabric(node) as f:
            return {(m.uuid, m.fdid) for m in f.mdevs()}

    def domains(self) -> dict[str, bytes]:
        """Every simulated node's domain files (persistent and live XML), by path."""
        root = self.state_path.parent / "hv"
        if not root.exists():
            return {}
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.xml"))}

    def snapshot(self) -> tuple[object, ...]:
        """Everything a refused command must leave as it was."""
        with self.fabric() as f:
            devices = sorted((d.fdid, d.state.value, str(d.holder)) for d in f.devices())
            usage = sorted((ref, u.lut_used, u.segments_used) for ref, u in f.usage().items())
            nodes = [n.name for n in f.nodes()]
        mdevs = []
        for n in nodes:
            with self.fabric(n) as fn:
                mdevs += sorted((m.uuid, m.node) for m in fn.mdevs())
        return devices, usage, mdevs, self.domains()


def make_cluster(state_path: Path, text: str | None = None, node: str = "gamma") -> SimCluster:
    make_fabric(state_path, text, node=node).close()
    return SimCluster(state_path, node)


def hostdev_uuids(xml: bytes) -> list[str]:
    found = etree.fromstring(xml).xpath("devices/hostdev[@type='mdev']/source/address/@uuid")
    assert isinstance(found, list)
    return [str(u) for u in found]


def metadata_fdids(xml: bytes) -> list[str]:
    ns = {"v": "http://vmlend.org/xmlns/domain/1.0"}
    found = etree.fromstring(xml).xpath("metadata/v:vmlend/v:device/@fdid", namespaces=ns)
    assert isinstance(found, list)
    return [str(f) for f in found]


def one_line(result: Result, code: int = 1) -> str:
    """The single error line of a refused command (exit ``code``, no traceback)."""
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


class MetadataFails:
    """A hypervisor whose metadata API fails for device 0x10 after the hot-plug succeeded:
    the attach must roll back."""

    def __init__(self, hv) -> None:
        self._hv = hv

    def __getattr__(self, name):
        return getattr(self._hv, name)

    def set_metadata(self, name, uri, key, xml, live, config):
        if xml is not None and b"0x10" in xml:
            raise DomainDefinitionError("set metadata of", name, "metadata refused")
        return self._hv.set_metadata(name, uri, key, xml, live, config)


#: The CLI's option for the simulated borrower node.
GAMMA = ("-c", "sim:///gamma")


@pytest.fixture
def cluster(state_path, monkeypatch) -> SimCluster:
    monkeypatch.delenv("VMLEND_NODE", raising=False)
    monkeypatch.delenv("LIBVIRT_DEFAULT_URI", raising=False)
    return make_cluster(state_path)
