"""The hook pays only for what an operation uses: a plain domain or an ignored operation is
decided from the raw bytes without lxml, libvirt or the fabric; the installed script runs
isolated from site and the caller's PYTHON* variables. What a real hook process imported is
read from its ``sys.modules`` at exit (``tests/support/modtrace.py``): nothing here is timed."""

from __future__ import annotations

import io
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.support.modtrace import run_script
from tests.support.paths import REPO
from tests.support.simfabric import make_fabric
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
from vmlend.domain.metadata import NAMESPACE_URI
from vmlend.hook.contract import Action, parse_argv
from vmlend.hook.install import install_hook
from vmlend.hook.prefilter import NAMESPACE_FAMILY, OPERATIONS, concerns_vmlend
from vmlend.topology.model import MiB

REPO_HOOK = REPO / "hooks" / "vmlend-qemu"
PLAIN = b"<domain type='kvm'><name>plain</name><memory unit='KiB'>65536</memory></domain>"
HEAVY = (
    "lxml",
    "libvirt",
    "click",
    "vmlend.fabric",
    "vmlend.sim",
    "vmlend.kernel",
    "vmlend.domain",
    "vmlend.registry",
)


def vm_xml(fdids=(0x10, 0x12)) -> bytes:
    spec = DomainSpec(
        name="vm1",
        memory_bytes=512 * MiB,
        uuid=uuid.UUID("6f1c5a2e-0000-4000-8000-000000000009"),
        devices=[DeviceRequest(f) for f in fdids],
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


@pytest.fixture
def installed(tmp_path, state_path):
    make_fabric(state_path)
    # backend chosen: libvirtd's hook refuses simulated devices nobody chose (hook.simulated)
    return install_hook(tmp_path / "libvirt", state_path, "gamma", backend="sim").path


def shebang_flags(script: Path) -> list[str]:
    """The interpreter flags of the installed script's shebang (it runs with them)."""
    return script.read_text().splitlines()[0].split()[1:]


@pytest.mark.parametrize(
    ("argv", "xml"),
    [
        (["plain", "prepare", "begin", "-"], PLAIN),
        (["plain", "release", "end", "-"], PLAIN),
        (["plain", "migrate", "begin", "-"], PLAIN),
        (["vm1", "started", "begin", "-"], None),  # a vmlend domain, an operation we ignore
    ],
)
def test_calls_that_are_not_ours_import_nothing_heavy(installed, state_path, argv, xml):
    xml = vm_xml() if xml is None else xml
    env = {"PATH": "/nonexistent", "VMLEND_STATE": str(state_path)}
    for script, flags in ((REPO_HOOK, []), (installed, shebang_flags(installed))):
        run = run_script(script, argv, xml, env, flags)
        assert (run.code, run.stdout, run.stderr) == (0, b"", []), script
        assert "vmlend.hook.entry" in run.modules
        assert run.within(*HEAVY) == set(), script


def test_a_plain_domain_costs_the_prefilter_and_nothing_else(installed, state_path, tmp_path):
    # Beyond what the interpreter (and the tracing wrapper) load anyway, the plain-domain path
    # loads vmlend's hook entry and its byte prefilter: no typing, re, logging or pathlib.
    empty = tmp_path / "empty.py"
    empty.write_text("")
    flags = shebang_flags(installed)
    floor = run_script(empty, [], b"", None, flags).modules
    env = {"PATH": "/nonexistent", "VMLEND_STATE": str(state_path)}
    run = run_script(installed, ["plain", "prepare", "begin", "-"], PLAIN, env, flags)
    assert run.code == 0
    ours = {"vmlend", "vmlend.hook", "vmlend.hook.entry", "vmlend.hook.prefilter"}
    builtin = {"gc", "__future__"}  # compiled in / a few constants
    assert run.modules - floor <= ours | builtin and ours <= run.modules


def test_prepare_imports_the_domain_reader_and_the_fabric_but_not_cli_or_libvirt(
    installed, state_path
):
    # the caller's configuration file wins over the installed one (run_script keeps ours):
    # the simulator chosen here, as the installed file says
    env = {"VMLEND_STATE": str(state_path), "VMLEND_BACKEND": "sim"}
    flags = shebang_flags(installed)
    run = run_script(installed, ["vm1", "prepare", "begin", "-"], vm_xml(), env, flags)
    assert (run.code, run.stderr) == (0, [])
    assert {"lxml.etree", "vmlend.domain.info", "vmlend.ledger.ledger"} <= run.modules
    unused = ("click", "libvirt", "vmlend.cli", "vmlend.irq", "vmlend.hypervisor")
    unused += ("vmlend.domain.build", "vmlend.domain.templates", "vmlend.domain.rewrite")
    unused += ("etcd3gw", "requests")  # an SQLite host never loads the etcd client
    # A VM without NVMe shares: the share ledger and the NVMe geometry are not needed.
    unused += ("vmlend.ledger.nvmeshares", "vmlend.nvme.shares", "vmlend.nvme.spec")
    # Nor vmlend's own etcd modules, nor the byte-preserving writer (prepare writes no XML).
    unused += ("vmlend.registry.etcd_gateway", "vmlend.registry.etcd_store")
    unused += ("vmlend.domain.preserve", "difflib")
    # The registry holds the compiled topology: no topology validation (tomllib reads the
    # configuration file, vmlend.config).
    unused += ("vmlend.topology.parse",)
    assert run.within(*unused) == set()
    run = run_script(installed, ["vm1", "release", "end", "-"], vm_xml(), env, flags)
    assert (run.code, run.stderr) == (0, [])
    assert run.within("etcd3gw", "requests") == set()


def test_installed_hook_delivers_its_output_though_it_skips_interpreter_teardown(
    installed, state_path
):
    # The script ends with os._exit: what it wrote to stdout (migrate's rewritten XML) and
    # stderr (a refusal) must still reach libvirt whole, with the right exit code.
    from vmlend.hook.main import run

    env = {"PATH": "/nonexistent", "VMLEND_STATE": str(state_path), "VMLEND_NODE": "gamma"}
    xml = vm_xml()
    expected = io.BytesIO()
    assert run(["vm1", "migrate", "begin", "-"], io.BytesIO(xml), expected, environ=env) == 0
    out = subprocess.run(
        [str(installed), "vm1", "migrate", "begin", "-"],
        input=xml,
        capture_output=True,
        env=env,
        timeout=60,
    )
    assert (out.returncode, out.stderr) == (0, b"")
    assert out.stdout == expected.getvalue() and out.stdout.rstrip().endswith(b"</domain>")
    unknown = vm_xml(fdids=(0x10, 0x7777))
    out = subprocess.run(
        [str(installed), "vm1", "prepare", "begin", "-"],
        input=unknown,
        capture_output=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.decode().count("\n") == 1 and "0x7777" in out.stderr.decode()


def test_prepare_and_release_of_a_four_device_vm_never_import_dataclasses(installed, state_path):
    # vmlend's records are msgspec Structs: ``dataclasses`` (inspect, ast, dis, tokenize) and
    # the per-class code generation of @dataclass cost the hook more than its own work.
    # the caller's configuration file wins over the installed one (run_script keeps ours):
    # the simulator chosen here, as the installed file says
    env = {"VMLEND_STATE": str(state_path), "VMLEND_BACKEND": "sim"}
    flags = shebang_flags(installed)
    xml = vm_xml((0x10, 0x12, 0x21, 0x22))
    for op in (["prepare", "begin", "-"], ["release", "end", "-"]):
        run = run_script(installed, ["vm1", *op], xml, env, flags)
        assert (run.code, run.stderr) == (0, []), op
        assert "vmlend.ledger.ledger" in run.modules, op  # it did the work
        assert "dataclasses" not in run.modules, op


def test_installed_hook_ignores_the_callers_python_environment(installed, state_path, tmp_path):
    # A PYTHONPATH with a broken 'vmlend' (or any PYTHON* setting libvirtd happens to carry)
    # must not change what the hook runs.
    decoy = tmp_path / "decoy" / "vmlend"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise SystemExit('decoy vmlend imported')\n")
    env = {
        "PATH": "/nonexistent",
        "VMLEND_STATE": str(state_path),
        "PYTHONPATH": str(decoy.parent),
    }
    xml = vm_xml()
    for op in (["prepare", "begin", "-"], ["release", "end", "-"]):
        out = subprocess.run(
            [str(installed), "vm1", *op], input=xml, capture_output=True, env=env, timeout=60
        )
        assert out.returncode == 0, out.stderr
    assert "-IS" in installed.read_text().splitlines()[0]


def test_installed_hook_for_another_interpreter_keeps_its_site(tmp_path):
    other = "/usr/bin/python3"  # its site dirs are not ours to pin
    text = install_hook(tmp_path, tmp_path / "s.db", None, interpreter=other).path.read_text()
    assert text.splitlines()[0] == f"#!{other}" and "sys.path" not in text


def test_prefilter_follows_the_namespace_and_the_contract():
    assert NAMESPACE_URI.encode().startswith(NAMESPACE_FAMILY)
    for (op, sub), action in OPERATIONS.items():
        assert parse_argv(["vm", op, sub]).action is Action(action)
    xml = vm_xml()
    assert concerns_vmlend(["vm1", "prepare", "begin", "-"], xml)
    assert not concerns_vmlend(["vm1", "start", "begin", "-"], xml)
    assert not concerns_vmlend(["plain", "prepare", "begin", "-"], PLAIN)
    # A newer metadata version still reaches the full parse (which refuses it).
    assert concerns_vmlend(["vm1", "prepare", "begin"], xml.replace(b"/1.0", b"/2.0"))
    assert concerns_vmlend(["vm1"], b"")  # bad argv: the full path reports it


def test_the_simulated_hypervisors_hook_entry_is_as_lean(tmp_path):
    # `python -m vmlend.hook --state S --node N ...`, what the simulated hypervisor runs.
    import vmlend.hook.__main__ as entry

    state = tmp_path / "never" / "state.db"
    args = ["--state", str(state), "--node", "gamma", "plain", "prepare", "begin", "-"]
    run = run_script(Path(entry.__file__), args, PLAIN)
    assert (run.code, run.stdout, run.stderr) == (0, b"", [])
    assert run.within(*HEAVY) == set() and not state.parent.exists()


def test_timeouts_from_the_environment_that_are_not_finite_fall_back_to_the_defaults():
    from vmlend.hook.forward import DEFAULT_TIMEOUT, answer_timeout
    from vmlend.hook.server import READ_TIMEOUT, read_timeout_from_env

    for value in ("1e400", "inf", "nan", "-1", "x"):
        assert answer_timeout({"VMLEND_HOOK_TIMEOUT": value}) == DEFAULT_TIMEOUT
        assert read_timeout_from_env({"VMLEND_AGENT_READ_TIMEOUT": value}) == READ_TIMEOUT
    assert answer_timeout({"VMLEND_HOOK_TIMEOUT": "3"}) == 3.0
