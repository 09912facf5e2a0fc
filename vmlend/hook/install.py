"""Install the hook executable into a libvirt config dir.

libvirtd decides at start-up whether hooks are enabled at all (``hooks/qemu`` or a non-empty
``hooks/qemu.d/`` must exist then); files added to ``qemu.d`` later are picked up. So we report
whether a daemon restart is needed. The installed script pins the interpreter (libvirtd's PATH
is not the user's) and the state path (libvirtd's environment is not the user's either).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from vmlend.errors import ConfigError

DEFAULT_NAME = "qemu.d/vmlend"
_MARK = "# installed by 'vmlend hook install'"


@dataclass(frozen=True)
class InstallResult:
    path: Path
    changed: bool  # False when an identical hook was already there
    restart_needed: bool  # hooks were not enabled for a running libvirtd

    def advice(self) -> str:
        if self.restart_needed:
            return (
                f"installed {self.path}; restart libvirtd (hooks are only enabled when the "
                "hook dir exists at daemon start)"
            )
        return f"installed {self.path}" if self.changed else f"{self.path} is already installed"


def hook_script(
    interpreter: str, state_path: Path, node: str | None, registry: str | None = None
) -> str:
    """The text of the installed hook (the same body as hooks/vmlend-qemu). ``registry``: a
    registry URL to pin (libvirtd's environment does not carry the caller's)."""
    lines = [
        f"#!{interpreter}",
        _MARK,
        "import os",
        "import sys",
        "",
        f"os.environ.setdefault('VMLEND_STATE', {str(state_path)!r})",
    ]
    if registry:
        lines.append(f"os.environ.setdefault('VMLEND_REGISTRY', {registry!r})")
    if node:
        lines.append(f"os.environ.setdefault('VMLEND_NODE', {node!r})")
    backend = os.environ.get("VMLEND_BACKEND")
    if backend:
        lines.append(f"os.environ.setdefault('VMLEND_BACKEND', {backend!r})")
    lines += ["", "from vmlend.hook.main import run", "", "sys.exit(run())", ""]
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
) -> InstallResult:
    if name not in ("qemu", DEFAULT_NAME) and not name.startswith("qemu.d/"):
        raise ConfigError(f"hook name must be 'qemu' or 'qemu.d/<name>', got {name!r}")
    hooks_dir = libvirt_dir / "hooks"
    target = hooks_dir / name
    text = hook_script(interpreter or sys.executable, state_path, node, registry)
    restart = not hooks_enabled(hooks_dir)
    if target.exists():
        current = target.read_text(errors="replace")
        if current == text and os.access(target, os.X_OK):
            return InstallResult(target, changed=False, restart_needed=restart)
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
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, target)  # atomic: libvirtd never runs a half-written hook
    except OSError as e:
        raise ConfigError(f"cannot install the hook at {target}: {e.strerror}") from None
    return InstallResult(target, changed=True, restart_needed=restart)


def uninstall_hook(libvirt_dir: Path, name: str = DEFAULT_NAME) -> bool:
    target = libvirt_dir / "hooks" / name
    if not target.exists():
        return False
    if _MARK not in target.read_text(errors="replace"):
        raise ConfigError(f"{target} was not installed by vmlend; not removing it")
    target.unlink()
    return True
