"""What every command shares: error handling and output helpers (the context object is in
``context``)."""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from vmlend.errors import ConfigError, VmlendError
from vmlend.messages import single_line
from vmlend.views.table import render_table

log = logging.getLogger("vmlend")


class VmlendGroup(click.Group):
    """Turns ``VmlendError`` into a one-line error and exit 1 (click uses 2 for usage)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["vmlend.argv"] = list(args)  # for the re-run line after Ctrl-C
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ConfigError as e:
            # Bad arguments or input files are the user's to fix: still exit 1, one line.
            raise click.ClickException(single_line(str(e))) from None
        except VmlendError as e:
            # One line even when the message quotes a user's value holding a newline.
            raise click.ClickException(single_line(str(e))) from None
        except KeyboardInterrupt:
            # Every operation is re-runnable: say which command picks up where this one stopped.
            again = shlex.join(["vmlend", *ctx.meta.get("vmlend.argv", [])])
            click.echo(
                f"vmlend: interrupted; run '{again}' again to finish (it picks up where this"
                " one stopped), then 'vmlend reconcile' to check",
                err=True,
            )
            raise SystemExit(130) from None


def json_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """The ``--json`` flag every data or action command carries (``emit_json`` prints it)."""
    return click.option("--json", "json_output", is_flag=True, help="Print JSON on stdout.")(f)


def format_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--format dot|mermaid``: a picture instead of the table (``--json`` stays the data)."""
    return click.option(
        "--format",
        "picture",
        type=click.Choice(["text", "dot", "mermaid"]),
        default="text",
        show_default=True,
        help="Draw it: Graphviz DOT ('dot -Tsvg') or Mermaid (Markdown viewers).",
    )(f)


def check_one_output(json_output: bool, picture: str) -> None:
    if json_output and picture != "text":
        raise click.UsageError("--json and --format are exclusive: choose one output")


def hook_socket_option(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--hook-socket PATH`` (env ``VMLEND_HOOK_SOCKET``, the variable the installed hook
    reads): the agent's socket, made absolute; None when not given (each command's default is
    the one under the host root, ``hostlease.hook_socket_path``)."""

    def absolute(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
        return Path(value).absolute() if value else None

    return click.option(
        "--hook-socket",
        envvar="VMLEND_HOOK_SOCKET",
        type=click.Path(dir_okay=False),
        callback=absolute,
        help=help_text + " [env VMLEND_HOOK_SOCKET; default <root>/run/vmlend/hook.sock].",
    )


#: The version every ``--json`` document carries under ``"format"``. Bumped when a field
#: changes meaning or goes away; a new field may appear without a bump (docs/user-guide.md,
#: "JSON output").
JSON_FORMAT = "vmlend/1"


def emit_json(data: Mapping[str, Any]) -> None:
    """Print one ``--json`` document: an object whose first key is ``"format"``. Every command's
    JSON goes through here, so every document carries the version in the same place; a listing
    puts its list under a named key (``{"format": ..., "devices": [...]}``)."""
    import json  # only --json output uses it

    if "format" in data:
        raise ValueError(f"a JSON document's own 'format' key would hide {JSON_FORMAT!r}")
    document = {"format": JSON_FORMAT, **data}
    click.echo(json.dumps(document, indent=2, sort_keys=False, default=str))


def emit_action(action: str, **fields: Any) -> None:
    """The ``--json`` of an action command: what it did (``"started"``, ``"removed"``, ...;
    ``"unchanged"`` when there was nothing to do) and what it did it to."""
    emit_json({"action": action, **fields})


def emit_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    click.echo(render_table(headers, rows))


def _more_verbose(ctx: click.Context, _param: click.Parameter, value: int) -> None:
    if not value:
        return
    from vmlend.cli.context import CliContext  # a callback: the command is running

    obj = ctx.find_object(CliContext)
    level = (obj.verbose if obj is not None else 0) + value
    if obj is not None:
        obj.verbose = level
    # vmlend's own loggers only: the handler basicConfig installed prints them.
    logging.getLogger("vmlend").setLevel(logging.DEBUG if level > 1 else logging.INFO)


def verbose_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``-v`` after a subcommand too (``vmlend detach VM FDID -v``), not only before it."""
    return click.option(
        "-v",
        "--verbose",
        count=True,
        expose_value=False,
        callback=_more_verbose,
        help="More diagnostics on stderr (also accepted before the command).",
    )(f)


def read_input(path: str | Path, limit: int | None = None) -> bytes:
    """The bytes of a user's input file (domain XML, topology TOML): a regular file of bounded
    size (``limit``, default ``safefile.MAX_INPUT_BYTES``), so a FIFO or ``/dev/zero`` is
    refused with one line instead of blocking or growing memory. ``ConfigError`` when it
    cannot be read."""
    from vmlend import safefile

    try:
        return safefile.read_regular(path, limit or safefile.MAX_INPUT_BYTES)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None


class Seconds(click.FloatRange):
    """A number of seconds from ``min`` up: ``1e400`` (inf) and ``nan`` are refused, where a
    plain float range would take them (and wait for ever, or print "inf s")."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        import math

        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return seconds
