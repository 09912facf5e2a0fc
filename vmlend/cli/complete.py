"""Shell completion of what only the fabric and the hypervisor know: device ids, node names and
VM names (click's completion: ``eval "$(_VMLEND_COMPLETE=bash_source vmlend)"``).

Completion runs without the main command's callback, so the context is rebuilt from the
options parsed so far (``--state``, ``--registry``, ``--node``, ``--root``, ``-c``). It must
never fail or print: any error completes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
from click.shell_completion import CompletionItem

from vmlend.cli.bashcomplete import printable
from vmlend.cli.context import CliContext
from vmlend.topology.model import format_fdid

log = logging.getLogger(__name__)


def _context(ctx: click.Context) -> CliContext:
    top = ctx.find_root().params
    obj = CliContext.create(
        state_path=top.get("state_path"),
        node=top.get("node"),
        verbose=0,
        root=top.get("root"),
        registry=top.get("registry"),
    )
    obj.uri = top.get("uri")
    return obj


@contextmanager
def _quietly() -> Iterator[None]:
    """Nothing reaches the terminal from a completion: logging is off while it runs."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)


def _guarded(
    find: Callable[[click.Context, str], list[CompletionItem]],
) -> Callable[[click.Context, click.Parameter, str], list[CompletionItem]]:
    def complete(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[Any]:
        with _quietly():
            try:
                # a value with a newline would be read as two items by the shell
                return [i for i in find(ctx, incomplete) if printable(str(i.value))]
            except Exception as e:  # no state, no daemon, a broken file: complete nothing
                log.debug("completion: %s", e)
                return []

    return complete


def _fdids(ctx: click.Context, incomplete: str) -> list[CompletionItem]:
    with _context(ctx).fabric() as f:
        statuses = f.devices()
    out = []
    for st in statuses:
        text = format_fdid(st.fdid)
        if text.startswith(incomplete.lower()):
            holder = f" by {st.holder}" if st.holder else ""
            out.append(
                CompletionItem(text, help=f"{st.spec.kind} on {st.spec.lender}, {st.state}{holder}")
            )
    return out


def _nodes(ctx: click.Context, incomplete: str) -> list[CompletionItem]:
    with _context(ctx).fabric() as f:
        nodes = f.topology().nodes
    return [CompletionItem(n.name, help=n.hostname) for n in nodes if n.name.startswith(incomplete)]


def _vms(ctx: click.Context, incomplete: str) -> list[CompletionItem]:
    from vmlend.cli.connect import open_hv

    obj = _context(ctx)
    uri = ctx.params.get("uri") or obj.uri
    hv = open_hv(obj, uri)
    try:
        domains = hv.list_domains()
    finally:
        hv.close()
    return [
        CompletionItem(d.name, help=d.state.words) for d in domains if d.name.startswith(incomplete)
    ]


#: For ``shell_complete=`` of an argument or option.
complete_fdids = _guarded(_fdids)
complete_nodes = _guarded(_nodes)
complete_vms = _guarded(_vms)
