"""``vmlend doctor``: what this host has and lacks for lending devices to guests.

Each check is a small function of the ``HostEnv`` returning one ``Finding``; a ``FAIL`` blocks
use (the CLI exits non-zero), a ``WARN`` limits it. Nothing here starts, loads or changes
anything, and nothing waits on a daemon.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable
from pathlib import Path

import msgspec

from vmlend.errors import HostError, MdevError, VmlendError
from vmlend.hook.install import read_pins
from vmlend.hostenv import HostEnv
from vmlend.kernel import p2pcheck
from vmlend.kernel.dmafiles import DmaWord, compare_windows
from vmlend.kernel.driver import MDEV_TYPE, Availability, SmartioDriver, device_name, fdid_of
from vmlend.kernel.driver import MODULE as SMARTIO_MODULE
from vmlend.kernel.mdev import MdevBus
from vmlend.kernel.nvmeshare import lacking_share_files, share_support
from vmlend.ledger.shareops import SHARE_MDEV_TYPE

log = logging.getLogger(__name__)

#: What marks a hook file as vmlend's (the installer writes it into the script).
HOOK_MARK = "vmlend"


class Status(enum.StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


class Finding(msgspec.Struct, frozen=True):
    name: str
    status: Status
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"check": self.name, "status": self.status.value, "detail": self.detail}


def blocking(findings: list[Finding]) -> bool:
    return any(f.status is Status.FAIL for f in findings)


def _entries(path: Path) -> list[Path]:
    return sorted(path.iterdir()) if path.is_dir() else []


# --- what the host is: its CPU vendor, whether its kernel loads modules ------------------------

#: The kernel option that builds a module in, for a kernel without loadable modules.
BUILT_IN = {
    "vfio-pci": "CONFIG_VFIO_PCI",
    "mdev": "CONFIG_VFIO_MDEV",
    "kvm_intel": "CONFIG_KVM_INTEL",
    "kvm_amd": "CONFIG_KVM_AMD",
}


def kernel_release(env: HostEnv) -> str:
    """``uname -r`` of the host under the root (its ``proc/sys/kernel/osrelease``)."""
    try:
        return (env.proc / "sys" / "kernel" / "osrelease").read_text().strip()
    except OSError:
        return os.uname().release


def loads_modules(env: HostEnv) -> bool:
    """Whether ``modprobe`` can help: the kernel supports modules (``/proc/modules``) and has
    its module tree (``/lib/modules/$(uname -r)``)."""
    modules_dir = env.root / "lib" / "modules" / kernel_release(env)
    return (env.proc / "modules").exists() and modules_dir.is_dir()


def _load_advice(env: HostEnv, module: str) -> str:
    """How to get ``module``: ``modprobe`` where the kernel loads modules, else a kernel with
    it built in."""
    if loads_modules(env):
        return f"'modprobe {module}'"
    option = BUILT_IN.get(module)
    built = f"{option}=y" if option else f"{module} built in"
    return (
        f"this kernel loads no modules (no /proc/modules or /lib/modules/"
        f"{kernel_release(env)}): boot a kernel with {built}"
    )


def cpu_vendor(env: HostEnv) -> str:
    """ "intel", "amd" or "" (unknown), from ``proc/cpuinfo``."""
    try:
        text = (env.proc / "cpuinfo").read_text(errors="replace")
    except OSError:
        return ""
    if "GenuineIntel" in text:
        return "intel"
    return "amd" if "AuthenticAMD" in text else ""


# --- the checks ---------------------------------------------------------------------------------


def check_kvm(env: HostEnv) -> Finding:
    kvm = env.dev / "kvm"
    if kvm.exists():
        return Finding("kvm", Status.OK, f"{kvm} present")
    vendor = cpu_vendor(env)
    module = {"intel": "kvm_intel", "amd": "kvm_amd"}.get(vendor)
    firmware = {"intel": "VT-x", "amd": "AMD-V"}.get(vendor, "VT-x/AMD-V")
    load = _load_advice(env, module) if module else "load kvm_intel or kvm_amd"
    return Finding(
        "kvm",
        Status.FAIL,
        f"{kvm} missing: enable {firmware} in firmware (in a VM: nested virtualization), then"
        f" {load}",
    )


def check_iommu(env: HostEnv) -> Finding:
    groups = _entries(env.iommu_groups)
    units = _entries(env.iommu_class)
    if groups:
        return Finding("iommu", Status.OK, f"{len(groups)} IOMMU groups, {len(units)} IOMMU units")
    vendor = cpu_vendor(env)
    if vendor == "intel":
        advice = "enable VT-d in firmware and add intel_iommu=on to the kernel command line"
    elif vendor == "amd":
        advice = "enable AMD-Vi (IOMMU) in firmware (on by default on AMD kernels, amd_iommu=on)"
    else:
        advice = (
            "enable VT-d/AMD-Vi in firmware and intel_iommu=on or amd_iommu=on on the kernel"
            " command line"
        )
    return Finding("iommu", Status.FAIL, f"no IOMMU groups: {advice}")


def check_vfio_module(env: HostEnv) -> Finding:
    if env.module("vfio").is_dir():
        extra = " (vfio_pci loaded)" if env.module("vfio_pci").is_dir() else ""
        return Finding("vfio module", Status.OK, f"vfio loaded{extra}")
    return Finding(
        "vfio module", Status.FAIL, f"vfio is not loaded: {_load_advice(env, 'vfio-pci')}"
    )


def check_mdev_module(env: HostEnv) -> Finding:
    # Kernels from 5.16 on call it mdev; older ones had vfio_mdev on top of it.
    for name in ("mdev", "vfio_mdev"):
        if env.module(name).is_dir():
            return Finding("mdev module", Status.OK, f"{name} loaded")
    return Finding("mdev module", Status.FAIL, f"mdev is not loaded: {_load_advice(env, 'mdev')}")


def check_vfio_device(env: HostEnv) -> Finding:
    path = env.vfio_container
    if path.exists():
        return Finding("vfio device", Status.OK, f"{path} present")
    return Finding(
        "vfio device",
        Status.FAIL,
        f"{path} missing: load vfio ({_load_advice(env, 'vfio-pci')}); QEMU needs it for mdevs",
    )


def check_smartio(env: HostEnv, required: bool = False) -> Finding:
    driver = SmartioDriver(env)
    if not driver.loaded():
        return Finding(
            "smartio driver",
            Status.FAIL if required else Status.WARN,
            f"not loaded ({_load_advice(env, SMARTIO_MODULE)}); only the simulated fabric works",
        )
    try:
        node = driver.node_id()
        devices, damaged = driver.scan()
    except HostError as e:
        return Finding("smartio driver", Status.FAIL, str(e))
    if damaged:
        more = f" (and {len(damaged) - 1} more damaged devices)" if len(damaged) > 1 else ""
        return Finding("smartio driver", Status.FAIL, f"{damaged[0]}{more}")
    available = sum(d.availability is Availability.AVAILABLE for d in devices)
    parents = sum(d.parent_registered for d in devices)
    return Finding(
        "smartio driver",
        Status.OK,
        f"node {node}: {len(devices)} devices, {available} available, {parents} mdev parents here",
    )


def check_backend(env: HostEnv, backend: str | None) -> Finding:
    """The fabric backend this CLI uses (``backend``: the chosen one, None: the host's
    default), and whether it fits the host: the simulated fabric on a host with real
    virtualization (``/dev/kvm``) cannot give its VMs devices."""
    loaded = SmartioDriver(env).loaded()
    in_use = backend or ("smartio" if loaded else "sim")
    why = (
        "chosen"
        if backend
        else "the default: " + ("the SmartIO driver is loaded" if loaded else "no SmartIO driver")
    )
    if in_use == "smartio" and not loaded:
        return Finding(
            "backend",
            Status.FAIL,
            f"smartio ({why}), but the SmartIO driver is not loaded: load it"
            f" ({_load_advice(env, SMARTIO_MODULE)}) or choose --backend sim",
        )
    kvm = env.dev / "kvm"
    if in_use == "sim" and kvm.exists():
        return Finding(
            "backend",
            Status.WARN,
            f"sim ({why}) on a host with real virtualization ({kvm}): VMs with remote devices"
            " run only on simulated nodes (sim:///<node>), never on this host's libvirtd; load"
            " the SmartIO driver to lend real devices (docs/real-hardware.md)",
        )
    return Finding("backend", Status.OK, f"{in_use} ({why})")


def check_data_path(env: HostEnv) -> Finding | None:
    """Each ``smartio-lend`` child's DMA windows (docs/smartio-contract.md section 8): the
    group is there (a driver without it predates section 8: its devices reach no guest RAM),
    windows are written, a Bus Master enable was not refused, and what is mapped is what was
    written. Whether the windows are the VM's is ``vmlend reconcile``'s check (it reads the
    domain). None where the driver is not loaded or no child exists."""
    driver = SmartioDriver(env)
    if not driver.loaded():
        return None
    try:
        children = [
            d
            for d in MdevBus(env).devices()
            if d.type_id == MDEV_TYPE and fdid_of(d.parent) is not None
        ]
    except MdevError as e:
        return Finding("data path", Status.FAIL, str(e))
    if not children:
        return None
    problems: list[str] = []
    mapped = 0
    for child in children:
        report = driver.dma_report(child.uuid)
        where = f"mdev {child.uuid} ({child.parent})"
        if report is None:
            problems.append(
                f"{where} has no smartio/ group: the SmartIO driver predates the data path"
                " (docs/smartio-contract.md section 8), so no DMA window is mapped; update it"
            )
            continue
        if report.damaged:
            problems.append(f"{where}: {report.damaged}")
            continue
        if report.state is not None and report.state.word is DmaWord.MAPPED:
            mapped += 1
        # with nothing expected, compare_windows only flags a missing write if told: say it
        if report.written is None:
            problems.append(
                f"{where} has no DMA windows written: a Bus Master enable is refused; run"
                " 'vmlend reconcile --fix'"
            )
        problems += [
            f"{where}: {m.line}"
            for m in compare_windows(None, None, report.written, report.state)
        ]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return Finding("data path", Status.WARN, problems[0] + more)
    return Finding(
        "data path",
        Status.OK,
        f"{len(children)} children: DMA windows written, {mapped} mapped by the guest",
    )


def check_p2p(env: HostEnv) -> Finding | None:
    """Each child's peer-to-peer files for themselves (``vmlend.kernel.p2pcheck``); None
    where no child has them."""
    if not SmartioDriver(env).loaded():
        return None
    try:
        found = p2pcheck.look(env)
    except MdevError as e:
        return Finding("peer-to-peer", Status.FAIL, str(e))
    if found is None:
        return None
    if found.problems:
        return Finding("peer-to-peer", Status.WARN, p2pcheck.first(found.problems))
    return Finding("peer-to-peer", Status.OK, p2pcheck.summary(found))


def check_mdev_parents(env: HostEnv) -> Finding:
    try:
        parents = MdevBus(env).parents()
    except MdevError as e:
        return Finding("mdev parents", Status.FAIL, str(e))
    if not parents:
        return Finding("mdev parents", Status.WARN, "none registered yet")
    names = ", ".join(f"{p.name} ({'/'.join(t.type_id for t in p.types)})" for p in parents[:5])
    more = f" and {len(parents) - 5} more" if len(parents) > 5 else ""
    return Finding("mdev parents", Status.OK, f"{len(parents)}: {names}{more}")


def check_nvme_sharing(env: HostEnv) -> Finding:
    """Which NVMe drives the driver can share at the queue level, and why not the others.
    Informational: a drive that cannot be shared can still be lent whole."""
    driver = SmartioDriver(env)
    if not driver.loaded():
        return Finding("nvme sharing", Status.OK, "no SmartIO driver: the simulated fabric shares")
    try:
        drives = [d for d in driver.devices() if d.kind == "nvme"]
    except HostError as e:
        return Finding("nvme sharing", Status.OK, f"not checked: {e}")
    if not drives:
        return Finding("nvme sharing", Status.OK, "no NVMe drive in the fabric")
    parts = []
    for d in drives:
        support = share_support(driver, d.fdid)
        if support.supported:
            lacking = _share_children_lacking(env, driver, d.fdid)
            parts.append(
                f"{d.fdid:#x}: the driver offers {support.queue_pairs} queue pairs"
                + (f"; refused, share mdev {lacking}; lend it whole" if lacking else "")
            )
        else:
            parts.append(f"{d.fdid:#x}: refused, {support.why}; lend it whole")
    return Finding("nvme sharing", Status.OK, "; ".join(parts))


def _share_children_lacking(env: HostEnv, driver: SmartioDriver, fdid: int) -> str:
    """What the share children of ``fdid`` here lack of section 7's files ("" nothing, or no
    such child): a driver that offers shares but predates their files refuses every one."""
    try:
        children = MdevBus(env).devices()
    except MdevError:
        return ""
    for c in children:
        if c.type_id == SHARE_MDEV_TYPE and c.parent == device_name(fdid):
            lacking = lacking_share_files(driver, c.uuid)
            if lacking:
                return f"{c.uuid} has no {lacking}"
    return ""


def libvirt_library_version() -> str:
    """The libvirt library's version; ``getVersion()`` needs no daemon and no connection."""
    import libvirt

    v = libvirt.getVersion()
    return f"{v // 1_000_000}.{v // 1000 % 1000}.{v % 1000}"


def check_libvirt(version: Callable[[], str]) -> Finding:
    try:
        return Finding("libvirt", Status.OK, f"libvirt {version()}")
    except ImportError:
        return Finding(
            "libvirt", Status.FAIL, "libvirt-python is missing: 'pip install libvirt-python'"
        )
    except Exception as e:  # libvirt.libvirtError, or a broken library: report, don't crash
        return Finding("libvirt", Status.FAIL, f"libvirt library unusable: {e}")


def check_hypervisor(uri: str) -> Finding:
    """Whether the hypervisor at ``uri`` answers (a ``sim:///`` node is simulated: nothing to
    connect to)."""
    if uri.startswith("sim:///"):
        return Finding("hypervisor", Status.OK, f"{uri} is a simulated node")
    try:
        import libvirt

        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        conn = libvirt.open(uri)
    except ImportError:
        return Finding("hypervisor", Status.FAIL, "libvirt-python is missing")
    except Exception as e:  # libvirt.libvirtError: report, don't crash
        from vmlend.messages import single_line

        return Finding(
            "hypervisor",
            Status.FAIL,
            f"cannot connect to {uri}: {single_line(str(e))}; is libvirtd running?",
        )
    try:
        v = conn.getVersion()
        return Finding(
            "hypervisor",
            Status.OK,
            f"{uri}: {conn.getType()} {v // 1_000_000}.{v // 1000 % 1000}.{v % 1000}",
        )
    except Exception as e:
        return Finding("hypervisor", Status.WARN, f"{uri} answers, but not its version: {e}")
    finally:
        conn.close()


def hook_files(env: HostEnv) -> list[Path]:
    """Files libvirt runs for qemu events: ``hooks/qemu`` then ``hooks/qemu.d/*``."""
    hooks = env.libvirt_hooks
    main = [hooks / "qemu"] if (hooks / "qemu").is_file() else []
    return main + [p for p in _entries(hooks / "qemu.d") if p.is_file()]


def _is_vmlend_hook(path: Path) -> bool:
    try:
        return HOOK_MARK in path.read_text(errors="replace")
    except OSError:
        return False


def check_hook(env: HostEnv) -> Finding:
    ours = [p for p in hook_files(env) if _is_vmlend_hook(p)]
    if not ours:
        return Finding(
            "libvirt hook",
            Status.FAIL,
            f"no vmlend hook under {env.libvirt_hooks}: run 'vmlend hook install'",
        )
    hook = ours[0]
    if not hook.stat().st_mode & 0o111:
        return Finding("libvirt hook", Status.FAIL, f"{hook} is not executable: chmod +x it")
    return Finding("libvirt hook", Status.OK, str(hook))


def check_hook_trust(env: HostEnv) -> Finding | None:
    """Whether non-root can change what libvirtd runs as root through the vmlend hook (its
    file, interpreter, import roots, state directory). None without a vmlend hook."""
    ours = [p for p in hook_files(env) if _is_vmlend_hook(p)]
    if not ours:
        return None
    from vmlend.hook import trust
    from vmlend.hook.install import read_roots

    try:
        text = ours[0].read_text(errors="replace")
    except OSError as e:
        return Finding("hook ownership", Status.WARN, f"cannot read {ours[0]}: {e.strerror}")
    try:
        pins = read_pins(text)
    except VmlendError as e:
        return Finding("hook ownership", Status.FAIL, str(e))
    state = Path(pins["state"]) if pins.get("state") else ours[0].parent / "(no state pinned)"
    config = Path(pins["config"]) if pins.get("config") else None
    problems = trust.hook_problems(
        ours[0], pins.get("interpreter", ""), read_roots(text), state, config
    )
    if problems:
        return Finding(
            "hook ownership",
            Status.FAIL,
            f"libvirtd runs {ours[0]} as root from {len(problems)} path(s) non-root can change:"
            f" {trust.summary(problems)}; make them root's alone (docs/security.md)",
        )
    return Finding("hook ownership", Status.OK, "everything the hook runs or writes is root's")


def compare_pins(hook: Path, pinned: dict[str, str], cli: dict[str, str]) -> Finding:
    """The hook's pins (``read_pins``) against what this CLI uses (same keys; "" for unset).
    Another state or node means the hook and the CLI see different fabrics: FAIL. Another
    interpreter may be a venv upgrade: WARN."""
    if "state" not in pinned:
        return Finding(
            "hook pins",
            Status.WARN,
            f"{hook} pins no registry (libvirtd's environment decides): re-run"
            " 'vmlend hook install' to pin this CLI's",
        )
    labels = {
        "config": "configuration file",
        "state": "registry",
        "registry": "registry URL",
        "node": "node",
        "backend": "backend",
    }
    differ = [
        f"{label} {pinned.get(key) or '(unset)'} vs {cli.get(key) or '(unset)'}"
        for key, label in labels.items()
        if (pinned.get(key) or "") != (cli.get(key) or "")
    ]
    if differ:
        return Finding(
            "hook pins",
            Status.FAIL,
            f"{hook} pins {'; '.join(differ)} (hook vs this CLI): re-run 'vmlend hook install'"
            " with this CLI's --config/--state/--registry/--node",
        )
    if pinned.get("interpreter") != cli.get("interpreter"):
        return Finding(
            "hook pins",
            Status.WARN,
            f"{hook} runs {pinned.get('interpreter') or '(unknown)'}, this CLI"
            f" {cli.get('interpreter')}: re-run 'vmlend hook install' if that is not intended",
        )
    same = cli.get("registry") or cli.get("state")
    return Finding("hook pins", Status.OK, f"same registry {same} as this CLI")


def check_hook_served(env: HostEnv) -> Finding | None:
    """Whether this host's agent serves the installed hook (the hook is ~6x faster then); an
    agent is never required, so this is at worst a WARN. None without a readable vmlend hook
    (``check_hook`` and ``check_hook_pins`` say so)."""
    ours = [p for p in hook_files(env) if _is_vmlend_hook(p)]
    try:
        pinned = read_pins(ours[0].read_text(errors="replace")) if ours else None
    except (OSError, VmlendError):
        pinned = None
    if pinned is None:
        return None
    from vmlend.hook.install import PINNED_ENV
    from vmlend.hook.probe import probe_agent
    from vmlend.registry.hostlease import hook_socket_path

    sock = Path(pinned.get("hook socket") or hook_socket_path(env))
    # What the hook process would send: its pins (and this root, as a hook run here would).
    hook_env = {PINNED_ENV[k]: v for k, v in pinned.items() if k in PINNED_ENV}
    hook_env.pop(PINNED_ENV["hook socket"], None)
    root = pinned.get("root") or str(env.root)
    if Path(root) != Path("/"):
        hook_env["VMLEND_ROOT"] = root
    answer = probe_agent(sock, hook_env)
    if answer == "served":
        return Finding("hook served", Status.OK, f"by the vmlend agent on {sock}")
    if answer == "not mine":
        return Finding(
            "hook served",
            Status.WARN,
            f"the vmlend agent on {sock} serves another registry, node or root than the hook;"
            " the hook works in-process (slower): run the agent with the hook's"
            " --state/--registry/--node",
        )
    if answer == "denied":
        return Finding(
            "hook served",
            Status.WARN,
            f"the vmlend agent on {sock} does not serve this user; run 'vmlend doctor' as root"
            " (libvirtd's user) to check the hook",
        )
    return Finding(
        "hook served",
        Status.WARN,
        f"no vmlend agent serves the hook ({sock}: {answer}); it works in-process (slower):"
        " start 'vmlend agent' to serve it",
    )


def check_hook_pins(env: HostEnv, cli: dict[str, str]) -> Finding | None:
    """None when there is no vmlend hook (``check_hook`` says so)."""
    ours = [p for p in hook_files(env) if _is_vmlend_hook(p)]
    if not ours:
        return None
    try:
        pinned = read_pins(ours[0].read_text(errors="replace"))
    except OSError as e:
        return Finding("hook pins", Status.WARN, f"cannot read {ours[0]}: {e.strerror}")
    except VmlendError as e:
        return Finding("hook pins", Status.FAIL, str(e))
    return compare_pins(ours[0], pinned, cli)


def _daemon_start(env: HostEnv) -> tuple[Path, float] | None:
    """The running QEMU daemon's pid file and start time (the pid file's mtime)."""
    for pidfile in env.libvirtd_pidfiles:
        try:
            pid = int(pidfile.read_text().strip())
        except (FileNotFoundError, ValueError):
            continue
        if env.process(pid).exists():
            return pidfile, pidfile.stat().st_mtime
    return None


def check_daemon_saw_hook(env: HostEnv, answering: str | None = None) -> Finding:
    """libvirtd enables hooks only if one existed when it started (docs/hooks.md), so some hook file
    must predate the daemon; later files in qemu.d are then picked up. ``answering``: a URI
    whose hypervisor answered (``-c``), for a daemon whose pid file is not where this host's
    would be (a session daemon, another root's)."""
    started = _daemon_start(env)
    if started is None and answering is not None:
        if not hook_files(env):
            return Finding("libvirtd", Status.OK, f"answers at {answering}")
        return Finding(
            "libvirtd",
            Status.WARN,
            f"answers at {answering}, with no pid file under {env.run}: whether it started"
            " after the hooks (and so runs them) cannot be told; restart it if unsure",
        )
    if started is None:
        return Finding("libvirtd", Status.WARN, "not running (no live pid file); start it")
    pidfile, when = started
    files = hook_files(env)
    if not files:
        return Finding("libvirtd", Status.WARN, f"running ({pidfile}), no hooks installed")
    if min(p.stat().st_mtime for p in files) <= when:
        return Finding("libvirtd", Status.OK, f"running ({pidfile}), started after the hooks")
    return Finding(
        "libvirtd",
        Status.FAIL,
        f"started before its hooks were installed, so it ignores them: restart libvirtd"
        f" ({pidfile})",
    )


def _local_daemon(uri: str) -> bool:
    """Whether ``uri`` names a daemon on this host (its hooks are the ones doctor checks): not
    a simulated node, not libvirt's in-process test driver, no remote host part."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    return parts.scheme.split("+")[0] not in ("sim", "test") and not parts.hostname


def run_checks(
    env: HostEnv,
    libvirt_version: Callable[[], str] = libvirt_library_version,
    smartio_required: bool = False,
    cli_pins: dict[str, str] | None = None,
    backend: str | None = None,
    uri: str | None = None,
) -> list[Finding]:
    """``cli_pins``: what the CLI uses (``interpreter``, ``config``, ``state``, ``registry``,
    ``node``, ``backend``), to compare with what the installed hook pins; None skips that
    check. ``backend``: the one chosen (None: the host's default). ``uri``: a hypervisor to
    check too."""

    findings = [
        check_backend(env, backend),
        check_kvm(env),
        check_iommu(env),
        check_vfio_module(env),
        check_mdev_module(env),
        check_vfio_device(env),
        check_smartio(env, required=smartio_required),
        check_mdev_parents(env),
        *([data] if (data := check_data_path(env)) is not None else []),
        *([p2p] if (p2p := check_p2p(env)) is not None else []),
        check_nvme_sharing(env),
        check_libvirt(libvirt_version),
    ]
    answering = None
    if uri is not None:
        findings.append(check_hypervisor(uri))
        if findings[-1].status is Status.OK and _local_daemon(uri):
            answering = uri
    findings += [
        check_hook(env),
        check_daemon_saw_hook(env, answering),
    ]
    trust = check_hook_trust(env)
    if trust is not None:
        findings.append(trust)
    if cli_pins is not None:
        pins = check_hook_pins(env, cli_pins)
        if pins is not None:
            findings.append(pins)
            served = check_hook_served(env)
            if served is not None:
                findings.append(served)
    for f in findings:
        log.debug("doctor %s: %s %s", f.name, f.status, f.detail)
    return findings
