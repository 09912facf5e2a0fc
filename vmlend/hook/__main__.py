"""``python -m vmlend.hook [--state PATH] [--registry URL] [--node NODE] [--backend B] DOMAIN OP
SUBOP EXTRA``: the qemu hook as the simulated hypervisor runs it
(``vmlend.wiring.hypervisor.hook_command``).

The state path and the node it plays come up front rather than through the environment, so one
process can drive several simulated nodes; libvirt's own argv follows them unchanged. After
moving them into this process's environment it runs the installed hook's own entry
(``entry.main_and_exit``): the same prefilter, forwarding to the host's agent, gc handling and
exit, so the simulator exercises the path a real libvirtd runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

from vmlend.settings import NODE_ENV, REGISTRY_ENV, STATE_ENV

_OPTIONS = {
    "--state": STATE_ENV,
    "--registry": REGISTRY_ENV,
    "--node": NODE_ENV,
    "--backend": "VMLEND_BACKEND",  # vmlend.wiring.fabric.BACKEND_ENV, without its imports
}


def split_options(argv: list[str], environ: MutableMapping[str, str]) -> list[str]:
    """Move leading ``--state``/``--registry``/``--node``/``--backend`` options into
    ``environ``; return libvirt's argv."""
    rest = list(argv)
    while len(rest) >= 2 and rest[0] in _OPTIONS:
        environ[_OPTIONS[rest[0]]] = rest[1]
        rest = rest[2:]
    return rest


def main() -> None:
    argv = split_options(sys.argv[1:], os.environ)  # this process's own environment
    from vmlend.hook.entry import main_and_exit

    main_and_exit(argv, caller=None)  # a simulated node, not libvirtd


if __name__ == "__main__":
    main()
