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
from typing import TYPE_CHECKING

import msgspec

from vmlend import config, safefile
from vmlend.errors import ConfigError
from vmlend.hook import trust
from vmlend.hostenv import HostEnv

if TYPE_CHECKING:
    from tomlkit import TOMLDocument

DEFAULT_NAME = "qemu.d/vmlend"
_MARK = "# installed by 'vmlend hook install'"


class InstallResult(msgspec.Struct, frozen=True):
    path: Path
    changed: bool  # False when an identical hook was already there
    restart_needed: bool  # hooks were not enabled for a running libvirtd
    pins: dict[str, str] = msgspec.field(default_factory=dict)  # what the hook runs with
    #: Paths non-root could change that the hook runs as root (installed anyway: --force).
    untrusted: list[str] = msgspec.field(default_factory=list)
    #: What became of the configuration file: "written", "updated" or "unchanged".
    config: str = "unchanged"

    def advice(self) -> str:
        if self.restart_needed:
            return (
                f"installed {self.path}; restart libvirtd (hooks are only enabled when the "
                "hook dir exists at daemon start)"
            )
        return f"installed {self.path}" if self.changed else f"{self.path} is already installed"


#: The settings the hook takes from its configuration file, by the name ``pins`` reports them
#: under (``vmlend.config.HOOK_KEYS`` spells them as the file does).
PINNED_ENV = {
    "state": "VMLEND_STATE",
    "registry": "VMLEND_REGISTRY",
    "node": "VMLEND_NODE",
    "backend": "VMLEND_BACKEND",
    "hook socket": "VMLEND_HOOK_SOCKET",
}
#: What the script itself pins: the configuration file and the host root.
SCRIPT_ENV = {"config": "VMLEND_CONFIG", "root": "VMLEND_ROOT"}
#: A configuration key -> the name ``pins`` reports it under.
_PIN_NAME = {"hook-socket": "hook socket"}


def read_script_pins(text: str) -> dict[str, str]:
    """What a hook script vmlend installed pins itself: ``interpreter`` (its ``#!`` line) and
    the ``os.environ.setdefault`` values (``config``, ``root``; a hook installed by an older
    vmlend: ``state``, ``registry``, ``node``, ``backend``, ``hook socket``)."""
    pins: dict[str, str] = {}
    lines = text.splitlines()
    if lines and lines[0].startswith("#!"):
        # the interpreter alone: the installed hook may add flags (-IS)
        shebang = lines[0][2:].split()
        pins["interpreter"] = shebang[0] if shebang else ""
    names = {env: key for key, env in (PINNED_ENV | SCRIPT_ENV).items()}
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


def read_pins(text: str) -> dict[str, str]:
    """What an installed hook runs with: its script's pins (``read_script_pins``) and the
    settings of the configuration file it pins (``state``, ``registry``, ``node``,
    ``backend``, ``hook socket``). ``ConfigError`` when that file is unusable."""
    pins = read_script_pins(text)
    if "config" in pins:
        path = pins["config"]
        root = config.host_root(pins.get("root"), environ={})
        by_env = config.hook_settings(config.read_config(path, required=True), path, root)
        for key, env in PINNED_ENV.items():
            if env in by_env:
                pins.setdefault(key, by_env[env])
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
    config_file: Path,
    root: Path,
    roots: list[str] | None = None,
) -> str:
    """The text of the installed hook (the same body as hooks/vmlend-qemu). With ``roots``
    the interpreter runs isolated and without ``site``, importing from ``roots`` only. It pins
    the configuration file (which says the state, registry, node, backend and hook socket) and
    the host root: libvirtd's environment carries neither."""
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
    lines += [
        "",
        f"os.environ.setdefault('VMLEND_CONFIG', {str(config_file)!r})",
        f"os.environ.setdefault('VMLEND_ROOT', {str(root)!r})",
        "",
        "from vmlend.hook.entry import main_and_exit",
        "",
        "main_and_exit()",
        "",
    ]
    return "\n".join(lines)


#: The first lines of a configuration file ``hook install`` creates.
NEW_CONFIG_HEADER = (
    '# vmlend\'s configuration (docs/user-guide.md, "Configuration"): created by\n'
    "# 'vmlend hook install'; the CLI, the agent and the libvirt hook all read it.\n"
)


def config_text(current: str | None, settings: dict[str, str]) -> str:
    """``current`` (a configuration file's text; None: there is none) with its top-level hook
    settings (``config.HOOK_KEYS``, as spelled there: ``hook_socket`` stays ``hook_socket``)
    set to ``settings``. tomlkit edits the document in place: the operator's comments (a
    comment after a replaced value too), order, blank lines and tables stay as they were; a new
    key goes after the last top-level one."""
    import tomlkit  # only 'hook install' writes the file

    doc = tomlkit.parse(current if current is not None else NEW_CONFIG_HEADER)
    for key, value in settings.items():
        spelling = next((k for k in config.spellings_of(key) if k in doc), None)
        if spelling is not None:
            doc[spelling] = value  # in place: its comment stays
            continue
        last = _last_top_level_key(doc)
        if last is None:
            doc[key] = value
        else:
            # Right after it, not after the comments that open the first table. tomlkit has no
            # public call for a position; _insert_after is the one its own setters use.
            doc._insert_after(last, key, value)
    return tomlkit.dumps(doc)


def _last_top_level_key(doc: TOMLDocument) -> str | None:
    from tomlkit.items import AoT, Table

    keys = [k.key for k, item in doc.body if k is not None and not isinstance(item, Table | AoT)]
    return keys[-1] if keys else None


def write_config(path: Path, settings: dict[str, str], root: Path) -> str:
    """Make the configuration file at ``path`` pin ``settings`` (the hook's top-level keys,
    absolute paths under ``root``, written as the file spells them: ``config.over_root``):
    "written" (there was none: created, its directory too), "updated" or "unchanged". The file
    is read as every reader reads it (``config.read_config_bytes``), so a file the hook would
    refuse is refused here, and replaced atomically keeping its owner and mode."""
    top = os.path.abspath(root)
    wanted = {config.HOOK_KEYS[k]: v for k, v in settings.items()}
    spelled = {k: _spelled(k, v, top) for k, v in settings.items()}
    data = config.read_config_bytes(path)
    current = None
    if data is not None:
        table = config.parse_config(data, str(path))
        if config.hook_settings(table, path, top) == wanted:
            return "unchanged"
        current = data.decode()
    text = config_text(current, spelled)
    check = config.hook_settings(config.parse_config(text.encode(), str(path)), path, top)
    if check != wanted:  # a layout the edit cannot handle (a key in a dotted table)
        raise ConfigError(
            f"cannot update {path}: write its top-level {', '.join(settings)} yourself"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        safefile.write_atomically(path, text.encode(), keep_owner=True, mode=0o644)
    except OSError as e:
        raise ConfigError(f"cannot write the configuration file {path}: {e.strerror}") from None
    return "updated" if data is not None else "written"


def _spelled(key: str, value: str, root: str) -> str:
    """How the configuration file spells ``value`` of hook key ``key``: paths as seen from
    inside the host root."""
    what = f"the {key.replace('-', ' ')}"
    if key in config.PATH_KEYS:
        return config.over_root(value, root, what)
    if key == "registry" and root != "/":
        return config.registry_paths(value, lambda p: config.over_root(p, root, what))
    return value


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
    backend: str | None = None,
    config_file: Path | None = None,
    root: Path | None = None,
) -> InstallResult:
    """Install the hook under ``libvirt_dir``/hooks, and make the configuration file it pins
    (``config_file``, default ``vmlend/vmlend.toml`` beside ``libvirt_dir``) say ``state_path``,
    ``registry``, ``node``, ``backend`` and ``hook_socket``. Paths are pinned absolute: libvirtd
    runs the hook from ``/``, so a relative state path would name another file for every VM.
    ``hook_socket``: the agent's hook socket (default: the one under ``root``, default
    ``$VMLEND_ROOT`` or /)."""
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
    host = HostEnv.from_env(root)
    root = Path(os.path.abspath(host.root))
    config_file = Path(
        os.path.abspath(config_file or libvirt_dir.parent / "vmlend" / "vmlend.toml")
    )
    hooks_dir = libvirt_dir / "hooks"
    target = hooks_dir / name
    # The roots are this interpreter's: another one runs with its own site instead.
    roots = import_roots() if interpreter == os.path.abspath(sys.executable) else None
    if hook_socket is None:
        from vmlend.registry import hostlease  # the registry package: only when needed

        hook_socket = hostlease.hook_socket_path(host)
    hook_socket = Path(os.path.abspath(hook_socket))
    settings = {"state": str(state_path)}
    if registry:  # a relative SQLite path as the CLI's own, from here
        registry = config.registry_paths(registry, os.path.abspath)
    for key, value in (("registry", registry), ("node", node), ("backend", backend)):
        if value:
            settings[key] = value
    settings["hook-socket"] = str(hook_socket)
    text = hook_script(interpreter, config_file, root, roots)
    restart = not hooks_enabled(hooks_dir)
    # libvirtd runs this as root: everything it runs, imports, reads or writes must be root's.
    problems = trust.hook_problems(target, interpreter, roots or [], state_path, config_file)
    if problems and not force:
        raise untrusted_problem(target, problems)
    pins = read_script_pins(text)
    pins.update({_PIN_NAME.get(k, k): v for k, v in settings.items()})
    current = target.read_text(errors="replace") if target.exists() else None
    if current is not None and _MARK not in current and not force:
        raise ConfigError(
            f"{target} exists and was not installed by vmlend; move it into "
            f"{hooks_dir / 'qemu.d'} or pass --force to replace it"
        )
    configured = write_config(config_file, settings, root)
    if current is not None and current == text and os.access(target, os.X_OK):
        return InstallResult(
            target,
            changed=configured != "unchanged",
            restart_needed=restart,
            pins=pins,
            untrusted=problems,
            config=configured,
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
        target,
        changed=True,
        restart_needed=restart,
        pins=pins,
        untrusted=problems,
        config=configured,
    )


def uninstall_hook(libvirt_dir: Path, name: str = DEFAULT_NAME) -> bool:
    target = libvirt_dir / "hooks" / name
    if not target.exists():
        return False
    if _MARK not in target.read_text(errors="replace"):
        raise ConfigError(f"{target} was not installed by vmlend; not removing it")
    target.unlink()
    return True
