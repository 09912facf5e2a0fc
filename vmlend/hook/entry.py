"""The hook executable's entry point (``hooks/vmlend-qemu`` and the script ``vmlend hook
install`` writes): drain stdin, and return at once when the call cannot concern vmlend.

Only ``prefilter`` is imported before that decision, so a plain domain or an ignored operation
costs an interpreter start and a byte search. Everything else happens in ``main.run``.
"""

from __future__ import annotations

import gc
import io
import os
import sys

from vmlend.hook.prefilter import concerns_vmlend

#: Who runs this hook process: ``LIBVIRTD`` when libvirtd does (the installed script and
#: ``hooks/vmlend-qemu``, through ``main_and_exit``); unset when a simulated node does
#: (``python -m vmlend.hook``). In the environment, so a call the agent serves carries it too
#: (``forward.pinned_environment``). Only a libvirtd can be asked to start a VM whose devices
#: exist only in the simulator (``vmlend.hook.simulated``).
CALLER_ENV = "VMLEND_HOOK_CALLER"
LIBVIRTD = "libvirtd"

TYPE_CHECKING = False  # typing itself is not imported: the plain-domain path must stay bare
if TYPE_CHECKING:
    from typing import NoReturn


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Drain stdin before anything can fail: libvirt writes the whole XML and must not see a
    # broken pipe.
    xml = sys.stdin.buffer.read()
    if not concerns_vmlend(argv, xml):
        return 0
    # The agent reads the configuration file for us if it serves this hook: no tomllib here
    from vmlend.hook.forward import forward_unconfigured

    if (served := forward_unconfigured(argv, xml)) is not None:
        return served
    from vmlend.config import hook_environment  # the configuration file the hook pins
    from vmlend.errors import VmlendError

    try:
        hook_environment(os.environ)
    except VmlendError as e:
        from vmlend.messages import single_line

        print(f"vmlend: {single_line(str(e))}", file=sys.stderr)  # one line for libvirt's log
        return 1
    from vmlend.hook.forward import forward  # to this host's agent, if it serves the hook

    if (served := forward(argv, xml)) is not None:
        return served
    # Importing creates tens of thousands of objects and none of them is garbage: collections
    # during the imports only cost time (~10 % of the hook's CPU time, measured).
    gc.disable()
    try:
        from vmlend.hook.main import load_handlers, run

        load_handlers()
    finally:
        gc.enable()
    return run(argv, stdin=io.BytesIO(xml))


def main_and_exit(argv: list[str] | None = None, *, caller: str | None = LIBVIRTD) -> NoReturn:
    """The installed script's body (and ``python -m vmlend.hook``'s, with ``caller`` None: a
    simulated node): ``main()``, then end the
    process without tearing the interpreter down. Freeing every module and object the fabric
    imported is work nobody needs (~10-30 ms, measured): the hook's files are written with
    unbuffered ``os.write``, its state commits are durable when they return, and stdout/stderr
    are flushed here."""
    if caller:
        os.environ[CALLER_ENV] = caller
    else:  # never inherited: a simulated node's hook is not libvirtd's
        os.environ.pop(CALLER_ENV, None)
    code = main(argv)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # libvirt stopped reading: nothing more to tell it
            code = code or 1
    os._exit(code)
