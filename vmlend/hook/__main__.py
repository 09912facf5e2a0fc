"""``python -m vmlend.hook [--state PATH] [--registry URL] [--node NODE] DOMAIN OP SUBOP
EXTRA``: the qemu hook.

The simulated hypervisor runs this as its hook command (``vmlend.cli.connect``), with the state
path and the node it plays given up front rather than through the environment, so one process
can drive several simulated nodes. libvirt's own argv follows them unchanged.
"""

from __future__ import annotations

import io
import os
import sys

from vmlend.hook.prefilter import concerns_vmlend
from vmlend.settings import NODE_ENV, REGISTRY_ENV, STATE_ENV

_OPTIONS = {"--state": STATE_ENV, "--registry": REGISTRY_ENV, "--node": NODE_ENV}


def split_options(argv: list[str], environ: dict[str, str]) -> list[str]:
    """Move leading ``--state``/``--registry``/``--node`` options into ``environ``; return
    libvirt's argv."""
    rest = list(argv)
    while len(rest) >= 2 and rest[0] in _OPTIONS:
        environ[_OPTIONS[rest[0]]] = rest[1]
        rest = rest[2:]
    return rest


def main() -> int:
    env = dict(os.environ)
    argv = split_options(sys.argv[1:], env)
    xml = sys.stdin.buffer.read()  # drained first, as libvirt's hook must (see entry.py)
    if not concerns_vmlend(argv, xml):
        return 0
    from vmlend.hook.main import run

    return run(argv, stdin=io.BytesIO(xml), environ=env)


if __name__ == "__main__":
    sys.exit(main())
