"""LibvirtHypervisor over libvirt's test driver, and the mapping of libvirt's errors."""

from __future__ import annotations

import libvirt
import pytest

from tests.support.paths import DATA
from vmlend.errors import (
    DomainDefinitionError,
    DomainOperationError,
    DomainStateError,
    HookFailedError,
    LibvirtError,
    UnknownDomainError,
    UnsupportedOperationError,
)
from vmlend.hypervisor.libvirt_hv import LibvirtHypervisor, map_error
from vmlend.wiring.hypervisor import open_hypervisor

DATA = DATA / "hypervisor"
NODE_URI = f"test://{DATA / 'node.xml'}"
DOMAIN_XML = (DATA / "domain.xml").read_bytes()
MDEV_XML = (DATA / "mdev-hostdev.xml").read_bytes()


@pytest.fixture
def hv(tmp_path):
    h = open_hypervisor(NODE_URI, state_dir=tmp_path, hook_command=None)
    yield h
    h.close()


def test_opens_libvirt_for_other_uris(hv):
    assert isinstance(hv, LibvirtHypervisor)
    assert hv.uri == NODE_URI and hv.node is None


def test_libvirt_host_can_name_its_fabric_node(tmp_path):
    hv = open_hypervisor(NODE_URI, state_dir=tmp_path, hook_command=None, node="gamma")
    assert hv.node == "gamma"
    hv.close()


def test_each_connection_has_its_own_domains(hv, tmp_path):
    hv.define(DOMAIN_XML)
    other = open_hypervisor(NODE_URI, state_dir=tmp_path, hook_command=None)
    assert other.list_domains() == []
    other.close()


@pytest.mark.parametrize("live", [True, False])
def test_test_driver_refuses_attach_and_detach_clearly(hv, live):
    hv.define(DOMAIN_XML)
    hv.start("vm1")
    with pytest.raises(UnsupportedOperationError, match="virDomainAttachDeviceFlags") as exc:
        hv.attach_device("vm1", MDEV_XML, live=live, config=not live)
    msg = str(exc.value)
    assert "\n" not in msg and "vm1" in msg and "not supported" in msg
    with pytest.raises(UnsupportedOperationError, match="virDomainDetachDeviceFlags"):
        hv.detach_device("vm1", MDEV_XML, live=live, config=not live)


def test_default_uri_from_environment_opens_libvirt(tmp_path):
    hv = open_hypervisor(
        None, state_dir=tmp_path, hook_command=None, env={"LIBVIRT_DEFAULT_URI": NODE_URI}
    )
    assert hv.uri == NODE_URI
    hv.close()
    hv.close()  # closing twice is harmless


def test_connection_failure_is_one_line(tmp_path):
    with pytest.raises(LibvirtError, match="cannot connect to test:///") as exc:
        open_hypervisor(f"test://{tmp_path / 'missing.xml'}", state_dir=tmp_path, hook_command=None)
    assert "\n" not in str(exc.value)


def test_closed_hypervisor_refuses_calls(hv):
    hv.close()
    with pytest.raises(DomainOperationError, match="closed"):
        hv.list_domains()


def test_shutdown_that_never_finishes_reports_a_timeout():
    # A guest that ignores ACPI: libvirt accepts the request, the domain stays running.
    class StubbornDomain:
        def shutdown(self):
            pass

        def state(self):
            return [libvirt.VIR_DOMAIN_RUNNING, 0]

    class Conn:
        def getURI(self):
            return "stub:///"

        def lookupByName(self, name):
            return StubbornDomain()

    now = [0.0]
    hv = LibvirtHypervisor(
        Conn(), clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)
    )
    with pytest.raises(LibvirtError, match="still running after 3 s") as exc:
        hv.shutdown("vm1", timeout=3)
    assert "destroy" in str(exc.value)
    assert 3.0 <= now[0] < 3.5


def _err(code: int, message: str) -> libvirt.libvirtError:
    e = libvirt.libvirtError(message)
    e.err = (code, libvirt.VIR_FROM_QEMU, message, 2, None, None, None, 0, 0)
    return e


@pytest.mark.parametrize(
    ("code", "message", "op", "cls"),
    [
        (
            libvirt.VIR_ERR_CONFIG_UNSUPPORTED,
            "unsupported configuration: Mediated host device assignment requires VFIO support",
            "attach device to",
            UnsupportedOperationError,
        ),
        (
            libvirt.VIR_ERR_OPERATION_INVALID,
            "Requested operation is not valid: domain is not running",
            "destroy",
            DomainStateError,
        ),
        (
            libvirt.VIR_ERR_HOOK_SCRIPT_FAILED,
            "Hook script execution failed: exit status 1: device 0x10 is held by alpha/vm9",
            "start",
            HookFailedError,
        ),
        (
            libvirt.VIR_ERR_XML_DETAIL,
            "(domain_definition):1: bad\n<x\n-^",
            "define",
            DomainDefinitionError,
        ),
        (
            libvirt.VIR_ERR_OPERATION_FAILED,
            "operation failed: clash",
            "define",
            DomainDefinitionError,
        ),
        (
            libvirt.VIR_ERR_OPERATION_FAILED,
            "operation failed: qemu died",
            "start",
            DomainOperationError,
        ),
    ],
)
def test_libvirt_errors_keep_libvirts_reason_in_one_line(code, message, op, cls):
    mapped = map_error(_err(code, message), op, "vm1", "qemu:///system")
    assert type(mapped) is cls
    assert str(mapped).startswith(f"{op} vm1 refused: {message.splitlines()[0]}")
    assert "\n" not in str(mapped)
    assert mapped.code == code


def test_no_domain_maps_to_unknown_domain():
    mapped = map_error(_err(libvirt.VIR_ERR_NO_DOMAIN, "Domain not found"), "start", "vm7", "x:///")
    assert isinstance(mapped, UnknownDomainError) and mapped.name == "vm7"


# --- live migration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("persistent", "undefine", "extra"),
    [
        (False, False, 0),
        (True, False, libvirt.VIR_MIGRATE_PERSIST_DEST),
        (True, True, libvirt.VIR_MIGRATE_PERSIST_DEST | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE),
    ],
)
def test_live_migration_is_live_peer_to_peer_with_the_persistence_asked(
    persistent, undefine, extra
):
    from vmlend.hypervisor import LiveMigration
    from vmlend.hypervisor.libvirt_hv import migrate_flags

    how = LiveMigration(persistent=persistent, undefine_source=undefine)
    assert migrate_flags(how) == (libvirt.VIR_MIGRATE_LIVE | libvirt.VIR_MIGRATE_PEER2PEER | extra)


def test_migration_uri_and_destination_xml_go_as_typed_parameters():
    from vmlend.hypervisor import LiveMigration
    from vmlend.hypervisor.libvirt_hv import migrate_params

    assert migrate_params(LiveMigration(), "vm1") == {}
    how = LiveMigration(
        migration_uri="tcp://127.0.0.1:49152", listen_address="127.0.0.1", dest_xml=b"<domain/>"
    )
    assert migrate_params(how, "vm1") == {
        libvirt.VIR_MIGRATE_PARAM_URI: "tcp://127.0.0.1:49152",
        libvirt.VIR_MIGRATE_PARAM_LISTEN_ADDRESS: "127.0.0.1",
        libvirt.VIR_MIGRATE_PARAM_DEST_XML: "<domain/>",
    }
    with pytest.raises(DomainDefinitionError, match="XML is not UTF-8"):
        migrate_params(LiveMigration(dest_xml=b"\xff"), "vm1")


def test_a_refused_live_migration_is_one_line_and_the_domain_still_runs(hv, tmp_path):
    from vmlend.hypervisor import LiveMigration

    hv.define(DOMAIN_XML)
    hv.start("vm1")
    other = open_hypervisor(NODE_URI, state_dir=tmp_path, hook_command=None)
    with pytest.raises(LibvirtError) as exc:
        hv.migrate_live("vm1", other, LiveMigration())
    assert "\n" not in str(exc.value) and str(exc.value).startswith("migrate vm1 refused: ")
    assert hv.lookup("vm1").active
    other.close()
