"""The hook process: libvirt's argv and stdin in, an exit code and one line of stderr out.

Kept thin and fast: libvirt runs it for every domain on every operation and waits. Whether a
call concerns vmlend at all is decided from argv and the raw stdin bytes (``prefilter``)
before anything heavy is imported: a plain domain, or an operation vmlend ignores, costs an
interpreter start and nothing more. The domain model, lxml and the fabric are imported only
for the calls that use them, and click and libvirt never. A VmlendError becomes one line on
stderr (libvirt shows it to the user) and exit 1; anything unexpected is logged with its
traceback in the action log and still reported in one line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO, TextIO

from vmlend.errors import RegistryUnreachableError, VmlendError
from vmlend.hook.contract import Action, HookCall, parse_argv
from vmlend.hook.prefilter import concerns_vmlend

if TYPE_CHECKING:
    from pathlib import Path

    from vmlend.domain.info import DomainXMLInfo
    from vmlend.fabric.base import Fabric
    from vmlend.hook.actionlog import ActionLog
    from vmlend.hook.loghandler import ActionLogHandler

#: Opens the fabric of a registry (an SQLite path or a registry URL) as a node.
FabricFactory = Callable[["Path | str", str | None], "Fabric"]


def _open_fabric(state_path: Path | str, node: str | None) -> Fabric:
    from vmlend.wiring.fabric import open_fabric

    return open_fabric(state_path, node)


def load_handlers() -> None:
    """Import what a call that concerns vmlend uses (``handle`` would import it on first use;
    the hook's entry does it up front, with the garbage collector paused)."""


def handle(
    call: HookCall,
    xml: bytes,
    state_path: Path | str,
    node: str | None,
    stdout: BinaryIO,
    open_fabric: FabricFactory = _open_fabric,
    *,
    actions: ActionLog,
    simulated_only: bool = False,
) -> int:
    """Do what ``call`` asks, recording it in ``actions`` (the log beside the state of the
    call's environment). Returns the exit code; raises VmlendError on failure.
    ``simulated_only``: libvirtd asks, and the fabric is the simulator only by default
    (``vmlend.hook.simulated``): a prepare with remote devices is refused."""
    from vmlend.hook.domainview import read_hook_domain, rewrite_for_this_host
    from vmlend.hook.ops import HookOps

    action = call.action
    if action is Action.IGNORE:
        return 0
    # Returning devices and reconciling a running guest must work from an inconsistent XML too.
    dom = read_hook_domain(xml, strict=action not in (Action.RELEASE, Action.RECONNECT))
    if dom is None:  # not a vmlend domain: touch nothing, change nothing
        return 0
    if action is Action.RELEASE:
        _release(dom, state_path, node, open_fabric, actions)
        return 0
    if action is Action.PREPARE and simulated_only and dom.devices:
        from vmlend.errors import SimulatedDevicesHookError

        raise SimulatedDevicesHookError(dom.name)  # before anything is reserved
    fabric = open_fabric(state_path, node)
    ops = HookOps(fabric, actions)
    if action is Action.PREPARE:
        ops.prepare(dom)
    elif action is Action.RECONNECT:
        ops.reconnect(dom)
    elif action in (Action.MIGRATE, Action.RESTORE):
        for dev in dom.devices:
            fabric.device(dev.fdid)  # an fdid unknown to this fabric cancels the migration
        out = rewrite_for_this_host(xml, fabric.local_node)
        stdout.write(out)
        stdout.flush()
        actions.record(dom.name, call.operation, f"rewrote XML for {fabric.local_node}")
    return 0


def _release(
    dom: DomainXMLInfo,
    state_path: Path | str,
    node: str | None,
    open_fabric: FabricFactory,
    actions: ActionLog,
) -> None:
    """Return the devices of a VM that stopped. Each registry call gets
    ``RELEASE_CALL_DEADLINE``, endpoints and retries included, not the gateway's usual
    timeouts: what cannot land by then is kept on the host (``release_journal``) and landed
    by the agent, so stopping a VM during an outage takes about one deadline."""
    from vmlend.hook.ops import HookOps
    from vmlend.registry.deadline import RELEASE_CALL_DEADLINE, each_call_within

    with each_call_within(RELEASE_CALL_DEADLINE):
        try:
            fabric = open_fabric(state_path, node)
        except RegistryUnreachableError as e:
            from vmlend.release_journal import pend_unopened

            def record(msg: str) -> None:
                actions.record(dom.name, "release", msg)

            pending = pend_unopened(dom, node, e, record)
            if pending is not None:
                raise pending from e
            return
        HookOps(fabric, actions).release(dom)


def run(
    argv: list[str] | None = None,
    stdin: BinaryIO | None = None,
    stdout: BinaryIO | None = None,
    stderr: TextIO | None = None,
    environ: dict[str, str] | None = None,
    open_fabric: FabricFactory = _open_fabric,
) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr
    env = dict(os.environ) if environ is None else environ
    # Drain stdin before anything can fail: libvirt writes the whole XML and must not see a
    # broken pipe.
    xml = stdin.read()
    try:
        call = parse_argv(argv)
    except VmlendError as e:
        from vmlend.messages import single_line

        print(f"vmlend: {single_line(str(e))}", file=stderr)  # one line for libvirt's log
        return 1
    if not concerns_vmlend(argv, xml):
        return 0  # not ours: touch nothing, not even the state file or the log
    return _run_for_vmlend(call, xml, stdout, stderr, env, open_fabric)


def _run_for_vmlend(
    call: HookCall,
    xml: bytes,
    stdout: BinaryIO,
    stderr: TextIO,
    env: dict[str, str],
    open_fabric: FabricFactory,
) -> int:
    from vmlend.hook.actionlog import ActionLog, log_path_for_state
    from vmlend.hostenv import HostEnv
    from vmlend.journal import open_system_log
    from vmlend.settings import registry_from_env, state_path_from_env

    state_path = state_path_from_env(env)  # its directory keeps the host's action log
    registry = registry_from_env(env)
    system = open_system_log(HostEnv.from_env(environ=env).root, "vmlend-hook", env)
    actions = ActionLog(log_path_for_state(state_path), system=system)
    handler, root_level = _log_to(actions, call.domain)
    try:
        return _run_logged(call, xml, stdout, stderr, env, open_fabric, registry, actions)
    finally:
        _stop_logging(handler, root_level)


def _run_logged(
    call: HookCall,
    xml: bytes,
    stdout: BinaryIO,
    stderr: TextIO,
    env: dict[str, str],
    open_fabric: FabricFactory,
    registry: Path | str,
    actions: ActionLog,
) -> int:
    from vmlend.settings import NODE_ENV

    name = call.domain
    if call.action is Action.RECONNECT:
        # A failing reconnect hook makes libvirt kill the running guest: never fail it.
        try:
            handle(call, xml, registry, env.get(NODE_ENV), stdout, open_fabric, actions=actions)
        except Exception as e:
            import traceback

            detail = str(e) if isinstance(e, VmlendError) else traceback.format_exc()
            actions.record(name, "reconnect", f"PROBLEM (guest kept running): {detail}")
        return 0
    simulated_only = False
    if call.action is Action.PREPARE:
        from vmlend.hook.simulated import simulated_only_by_default

        simulated_only = simulated_only_by_default(env)
    try:
        code = handle(
            call,
            xml,
            registry,
            env.get(NODE_ENV),
            stdout,
            open_fabric,
            actions=actions,
            simulated_only=simulated_only,
        )
    except VmlendError as e:
        from vmlend.messages import single_line

        print(f"vmlend: {single_line(str(e))}", file=stderr)  # one line for libvirt's log
        actions.record(name, f"{call.operation} {call.sub_operation}", f"FAILED: {e}")
        return 1
    except Exception as e:  # a bug: one line for libvirt, the traceback for us
        import traceback

        print(f"vmlend: internal error: {type(e).__name__}: {e} (see {actions.path})", file=stderr)
        actions.record(name, "internal-error", traceback.format_exc())
        return 1
    return code


def _log_to(actions: ActionLog, domain: str) -> tuple[ActionLogHandler, int]:
    """Library warnings of this call go to its domain's action log, for the call only: the
    handler takes the records of this thread alone, so in the agent (which runs calls on a
    worker thread) other threads' records never land in a domain's log."""
    import logging
    import threading

    from vmlend.hook.loghandler import ActionLogHandler

    handler = ActionLogHandler(actions, domain)
    thread = threading.get_ident()
    handler.addFilter(lambda record: record.thread == thread)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(min(level or logging.WARNING, logging.WARNING))
    return handler, level


def _stop_logging(handler: ActionLogHandler, root_level: int) -> None:
    import logging

    root = logging.getLogger()
    root.removeHandler(handler)
    root.setLevel(root_level)
