"""Install the hook executable into a libvirt config dir.

libvirtd decides at start-up whether hooks are enabled at all (``hooks/qemu`` or a non-empty
``hooks/qemu.d/`` must exist then); files added to ``qemu.d`` later are picked up. So we report
whether a daemon restart is needed. The installed script pins the interpreter (libvirtd's PATH
is not the user's) and the state path (libvirtd's environment is not the user's either).

libvirtd runs the hook for every domain on every operation, so its start-up counts: the script
runs the interpreter with ``-I -S`` and puts the import roots found at install time on
``sys.path`` itself. That skips ``site`` (every ``.pth`` file, an editable install's import
finder) and the caller's ``PYTHON*`` variables: about two thirds of a bare interpreter start
(``docs/hooks.md``, measured).
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path, PurePosixPath

import msgspec

from vmlend import safefile
from vmlend.errors import ConfigError
from vmlend.hook import trust
from vmlend.hostenv import HostEnv

DEFAULT_NAME = "qemu.d/vmlend"
_MARK = "# installed by 'vmlend hook install'"


class InstallResult(msgspec.Struct, frozen=True):
    path: Path
    changed: bool  # False when an identical hook was already there
    restart_needed: bool  # hooks were not enabled for a running libvirtd
    pins: dict[str, str] = msgspec.field(default_factory=dict)  # what the hook runs with
    #: Paths non-root could change that the hook runs as root (installed anyway: --force).
    untrusted: list[str] = msgspec.field(default_factory=list)

    def advice(self) -> str:
        if self.restart_needed:
            return (
                f"installed {self.path}; restart libvirtd (hooks are only enabled when the "
                "hook dir exists at daemon start)"
            )
        return f"installed {self.path}" if self.changed else f"{self.path} is already installed"


#: The environment the installed hook pins, by the name ``pins`` reports them under.
PINNED_ENV = {
    "state": "VMLEND_STATE",
    "registry": "VMLEND_REGISTRY",
    "node": "VMLEND_NODE",
    "backend": "VMLEND_BACKEND",
    "hook socket": "VMLEND_HOOK_SOCKET",
}


def read_pins(text: str) -> dict[str, str]:
    """What a hook script vmlend installed pins: ``interpreter`` (its ``#!`` line) and the
    ``os.environ.setdefault`` values (``state``, ``registry``, ``node``, ``backend``,
    ``hook socket``) it sets."""
    pins: dict[str, str] = {}
    lines = text.splitlines()
    if lines and lines[0].startswith("#!"):
        # the interpreter alone: the installed hook may add flags (-IS)
        shebang = lines[0][2:].split()
        pins["interpreter"] = shebang[0] if shebang else ""
    names = {env: key for key, env in PINNED_ENV.items()}
    prefix = "os.environ.setdefault("
    for line in lines:
        if not line.startswith(prefix):
            continue
        try:
            env, value = ast.literal_eval(line[len(prefix) - 1 :])
        except (ValueError, SyntaxError, TypeError):
            continue
        if env in names and isinstance(value, str):
            pins[names[env]] = value
    return pins


def read_roots(text: str) -> list[str]:
    """The import roots an installed hook puts on ``sys.path`` (none for a hook that runs its
    interpreter with ``site``)."""
    prefix = "sys.path[:0] = "
    for line in text.splitlines():
        if line.startswith(prefix):
            try:
                roots = ast.literal_eval(line[len(prefix) :])
            except (ValueError, SyntaxError):
                return []
            return [r for r in roots if isinstance(r, str)] if isinstance(roots, list) else []
    return []


def untrusted_problem(target: Path, problems: list[str]) -> ConfigError:
    return ConfigError(
        f"the hook {target} would run as root from {len(problems)} path(s) non-root can"
        f" change: {trust.summary(problems)}; make them owned by root and not group- or"
        " other-writable (docs/security.md), or pass --force to install anyway"
    )


def import_roots() -> list[str]:
    """Where this interpreter finds vmlend and its dependencies without ``site``: the directory
    holding the vmlend package (the source tree of an editable install) and the site dirs."""
    import site

    import vmlend

    roots = [str(Path(vmlend.__file__).resolve().parent.parent)]
    for d in site.getsitepackages():
        if d not in roots and Path(d).is_dir():
            roots.append(d)
    return roots


def hook_script(
    interpreter: str,
    state_path: Path,
    node: str | None,
    roots: list[str] | None = None,
    registry: str | None = None,
    hook_socket: Path | None = None,
) -> str:
    """The text of the installed hook (the same body as hooks/vmlend-qemu). With ``roots``
    the interpreter runs isolated and without ``site``, importing from ``roots`` only.
    ``registry``: a registry URL to pin (libvirtd's environment does not carry the caller's).
    ``hook_socket``: where this host's agent serves the hook (``vmlend.hook.forward``)."""
    lines = [f"#!{interpreter} -IS" if roots else f"#!{interpreter}", _MARK]
    if roots:
        lines += [
            "# -IS: no site (.pth files, import finders) and no PYTHON* variables; the import",
            "# roots were found by 'vmlend hook install'.",
            "import sys",
            "",
            f"sys.path[:0] = {roots!r}",
            "import os",
        ]
    else:
        lines += ["import os", "import sys"]
    lines += ["", f"os.environ.setdefault('VMLEND_STATE', {str(state_path)!r})"]
    if registry:
        lines.append(f"os.environ.setdefault('VMLEND_REGISTRY', {registry!r})")
    if node:
        lines.append(f"os.environ.setdefault('VMLEND_NODE', {node!r})")
    backend = os.environ.get("VMLEND_BACKEND")
    if backend:
        lines.append(f"os.environ.setdefault('VMLEND_BACKEND', {backend!r})")
    if hook_socket is not None:
        lines.append(f"os.environ.setdefault('VMLEND_HOOK_SOCKET', {str(hook_socket)!r})")
    lines += ["", "from vmlend.hook.entry import main_and_exit", "", "main_and_exit()", ""]
    return "\n".join(lines)


def hooks_enabled(hooks_dir: Path) -> bool:
    qemu_d = hooks_dir / "qemu.d"
    return (hooks_dir / "qemu").exists() or (qemu_d.is_dir() and any(qemu_d.iterdir()))


def install_hook(
    libvirt_dir: Path,
    state_path: Path,
    node: str | None = None,
    name: str = DEFAULT_NAME,
    interpreter: str | None = None,
    force: bool = False,
    registry: str | None = None,
    hook_socket: Path | None = None,
) -> InstallResult:
    """Install the hook under ``libvirt_dir``/hooks. Paths are pinned absolute: libvirtd runs
    the hook from ``/``, so a relative state path would name another file for every VM.
    ``hook_socket``: the agent's hook socket (default: the one under ``$VMLEND_ROOT`` or /)."""
    parts = PurePosixPath(name).parts
    if (
        not (parts == ("qemu",) or (len(parts) == 2 and parts[0] == "qemu.d"))
        or any(p in (".", "..") for p in parts)
        or not name.isprintable()  # a newline or an escape in a file name root runs
    ):
        raise ConfigError(
            f"hook name must be 'qemu' or 'qemu.d/<name>' (inside the hooks dir), got {name!r}"
        )
    interpreter = os.path.abspath(interpreter or sys.executable)
    state_path = Path(os.path.abspath(state_path))
    hooks_dir = libvirt_dir / "hooks"
    target = hooks_dir / name
    # The roots are this interpreter's: another one runs with its own site instead.
    roots = import_roots() if interpreter == os.path.abspath(sys.executable) else None
    if hook_socket is None:
        from vmlend.registry import hostlease  # the registry package: only when needed

        hook_socket = hostlease.hook_socket_path(HostEnv.from_env())
    hook_socket = Path(os.path.abspath(hook_socket))
    text = hook_script(interpreter, state_path, node, roots, registry, hook_socket)
    pins = read_pins(text)
    restart = not hooks_enabled(hooks_dir)
    # libvirtd runs this as root: everything it runs, imports or writes must be root's alone.
    problems = trust.hook_problems(target, interpreter, roots or [], state_path)
    if problems and not force:
        raise untrusted_problem(target, problems)
    if target.exists():
        current = target.read_text(errors="replace")
        if current == text and os.access(target, os.X_OK):
            return InstallResult(
                target, changed=False, restart_needed=restart, pins=pins, untrusted=problems
            )
        if _MARK not in current and not force:
            raise ConfigError(
                f"{target} exists and was not installed by vmlend; move it into "
                f"{hooks_dir / 'qemu.d'} or pass --force to replace it"
            )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Not inside qemu.d: libvirt runs every executable there, dotfiles included. hooks/ is
        # on the same filesystem, so the rename stays atomic.
        tmp = hooks_dir / f".vmlend-install.{os.getpid()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        with os.fdopen(safefile.open_nofollow(tmp, flags, 0o700), "w") as f:
            f.write(text)
            os.fchmod(f.fileno(), 0o755)
        os.replace(tmp, target)  # atomic: libvirtd never runs a half-written hook
    except OSError as e:
        raise ConfigError(f"cannot install the hook at {target}: {e.strerror}") from None
    return InstallResult(
        target, changed=True, restart_needed=restart, pins=pins, untrusted=problems
    )


def uninstall_hook(libvirt_dir: Path, name: str = DEFAULT_NAME) -> bool:
    target = libvirt_dir / "hooks" / name
    if not target.exists():
        return False
    if _MARK not in target.read_text(errors="replace"):
        raise ConfigError(f"{target} was not installed by vmlend; not removing it")
    target.unlink()
    return True
