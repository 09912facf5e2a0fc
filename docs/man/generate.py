"""Writes vmlend's man pages, one per command and group, from the click commands themselves
(``make man``). ``tests/unit/cli/test_manpages.py`` fails when the pages in ``docs/man`` no
longer match the commands.

Each page has NAME (the command's first sentence, whole), SYNOPSIS, DESCRIPTION (its help),
OPTIONS, COMMANDS (a group's), EXAMPLES (the command lines docs/user-guide.md shows for it,
which tests/scenarios/test_docs_walkthroughs.py runs unless the guide says why not), FILES and
ENVIRONMENT (the paths and variables the help of its options and of the global options names:
every command takes those) and SEE ALSO (its group, its siblings or subcommands, and the
commands its help names). The roff is written here rather than by click-man, which cut NAME
to 45 characters and has none of the last four sections.
"""

from __future__ import annotations

import inspect
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from vmlend import __version__
from vmlend.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "user-guide.md"
#: The most example lines one page shows.
MAX_EXAMPLES = 8

_FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
#: A word a reader replaces (NAME, FDID), an optional part or an ellipsis: a synopsis line, not
#: an example (the rule of tests/scenarios/test_docs_walkthroughs.py).
_PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]{1,}\b|\[|\.\.\.")
#: An absolute path in an option's help (``<root>/run/...`` too), not inside another word.
_PATH = re.compile(r"(?<![\w/.])(?:<root>)?/(?:etc|var|run|usr|lib|dev|sys|proc)/[^\s,;)\]'\"]*")
#: An environment variable an option's help names: ``$NAME`` or ``env NAME``.
_ENV = re.compile(r"\$([A-Z][A-Z0-9_]+)|\benv ([A-Z][A-Z0-9_]+)")
#: A vmlend command the help names (``'vmlend devices'``, ``vmlend hook install``).
_MENTION = re.compile(r"\bvmlend((?: [a-z][a-z-]*){1,2})")


# --- the commands ---------------------------------------------------------------------------
def commands(
    command: click.Command = main, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """Every command and group under ``command`` (itself first), by name."""
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            if not sub.hidden:
                yield from commands(sub, (*path, name))


def command_at(words: list[str]) -> tuple[str, ...]:
    """The command path a command line's words (after ``vmlend``) run: the global options
    (and their values) skipped, then as many subcommand names as match."""
    valued = {
        opt
        for p in main.params
        if isinstance(p, click.Option) and not p.is_flag and not p.count
        for opt in p.opts
    }
    i = 0
    while i < len(words) and words[i].startswith("-"):
        name = words[i].partition("=")[0]
        i += 2 if name in valued and "=" not in words[i] else 1
    path: list[str] = []
    command: click.Command = main
    for word in words[i:]:
        if not isinstance(command, click.Group) or word not in command.commands:
            break
        command = command.commands[word]
        path.append(word)
    return tuple(path)


def first_sentence(command: click.Command) -> str:
    """The first sentence of the help, whole (what ``vmlend --help`` lists), without its
    full stop: a man page's NAME."""
    paragraph = " ".join(inspect.cleandoc(command.help or "").partition("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(?:\s|$)", paragraph)
    return (m[1] if m else paragraph).rstrip(".")


def global_options() -> list[click.Option]:
    return [p for p in main.params if isinstance(p, click.Option) and not p.hidden]


def own_options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and not p.hidden]


# --- what the user guide shows --------------------------------------------------------------
def guide_examples(text: str) -> list[tuple[tuple[str, ...], str]]:
    """Every concrete ``vmlend`` command line of the guide's code blocks, in order, with the
    command path it runs (a synopsis line, with placeholders, is none)."""
    out = []
    for block in _FENCE.finditer(text):
        for line in block.group(1).splitlines():
            line = line.removeprefix("$ ")
            if not line.startswith("vmlend "):
                continue
            line = line.split(" #")[0].strip()
            if _PLACEHOLDER.search(line):
                continue
            try:
                words = shlex.split(line)[1:]
            except ValueError:
                continue
            out.append((command_at(words), line))
    return out


def examples_of(path: tuple[str, ...], examples: list[tuple[tuple[str, ...], str]]) -> list[str]:
    """The guide's lines for ``path``: its own, its subcommands' for a group (the root: the
    guide's first ones), each once, at most ``MAX_EXAMPLES``."""
    lines = [line for p, line in examples if p[: len(path)] == path]
    return list(dict.fromkeys(lines))[:MAX_EXAMPLES]


# --- files, environment, related pages ------------------------------------------------------
def files_of(options: list[click.Option]) -> dict[str, str]:
    """Each path the options' help names, with the help of the first option naming it."""
    out: dict[str, str] = {}
    for option in options:
        for path in _PATH.findall(option.help or ""):
            out.setdefault(path.rstrip("."), _described(option))
    return out


def environment_of(options: list[click.Option]) -> dict[str, str]:
    """Each variable an option reads (``envvar``) or its help names, with that help."""
    out: dict[str, str] = {}
    for option in options:
        names = [option.envvar] if isinstance(option.envvar, str) else list(option.envvar or ())
        names += [a or b for a, b in _ENV.findall(option.help or "")]
        for name in names:
            out.setdefault(name, _described(option))
    return out


def _described(option: click.Option) -> str:
    opts = ", ".join(option.opts)
    return f"{opts}: {' '.join((option.help or '').split())}"


def see_also(path: tuple[str, ...], command: click.Command) -> list[tuple[str, ...]]:
    """The pages a reader of ``path`` goes on to: its group and the group's other commands (the
    top-level commands for the root), its subcommands, the commands its help names."""
    known = {p for p, _ in commands()}
    related: list[tuple[str, ...]] = []
    if path:
        parent = path[:-1]
        related.append(parent)
        if parent:
            related += [p for p in known if len(p) == len(path) and p[:-1] == parent]
        else:  # top-level commands of one module go together (attach/detach, lend/unlend)
            module = COMMANDS[path[0]][0]
            related += [(name,) for name, (m, _) in COMMANDS.items() if m == module]
    if isinstance(command, click.Group):
        related += [p for p in known if len(p) == len(path) + 1 and p[: len(path)] == path]
    for option in own_options(command):
        related += _mentions(option.help or "", known)
    related += _mentions(command.help or "", known)
    return sorted(dict.fromkeys(p for p in related if p != path))


def _mentions(text: str, known: set[tuple[str, ...]]) -> list[tuple[str, ...]]:
    out = []
    for m in _MENTION.finditer(text):
        words = tuple(m[1].split())
        while words and words not in known:
            words = words[:-1]
        if words:
            out.append(words)
    return out


# --- roff -----------------------------------------------------------------------------------
def roff(text: str) -> str:
    """Text as roff reads it literally: backslashes and hyphens escaped (a ``-`` stays a
    minus that copies as one), no line read as a request."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(f"\\&{ln}" if ln.startswith((".", "'")) else ln for ln in text.split("\n"))


def paragraphs(text: str) -> str:
    """Help text as roff paragraphs: a blank line starts a new one."""
    return "\n".join(".PP" if not ln.strip() else roff(ln) for ln in text.strip().split("\n"))


def page_name(path: tuple[str, ...]) -> str:
    return "-".join(("vmlend", *path))


def render(path: tuple[str, ...], command: click.Command, examples: list[str]) -> str:
    ctx = click.Context(main, info_name="vmlend")
    for name in path:
        ctx = click.Context(ctx.command.commands[name], info_name=name, parent=ctx)  # type: ignore[attr-defined]
    title = page_name(path)
    # .nh/.ad l: no hyphenation and a ragged right margin, so that option names, paths and
    # variables are never split or stretched
    lines = [f'.TH "{title.upper()}" "1" "" "vmlend {__version__}" "vmlend manual"', ".nh", ".ad l"]
    lines += [".SH NAME", f"{roff(title)} \\- {roff(first_sentence(command))}"]
    usage = " ".join(command.collect_usage_pieces(ctx))
    lines += [".SH SYNOPSIS", f".B {roff(ctx.command_path)}", roff(usage)]
    lines += [".SH DESCRIPTION", paragraphs(inspect.cleandoc(command.help or ""))]
    options = own_options(command)
    if options:
        lines.append(".SH OPTIONS")
        for option in options:
            record = option.get_help_record(ctx)
            if record is None:
                continue
            names, help_text = record
            lines += [".TP", f"\\fB{roff(names)}\\fR", paragraphs(help_text)]
    if isinstance(command, click.Group):
        lines.append(".SH COMMANDS")
        for name, sub in sorted(command.commands.items()):
            if sub.hidden:
                continue
            lines += [".TP", f"\\fB{roff(name)}\\fR", roff(first_sentence(sub) + ".")]
            lines.append(f"See \\fB{roff(page_name((*path, name)))}\\fR(1).")
    lines += [".SH EXAMPLES", ".PP", ".nf", ".RS 4", *(roff(e) for e in examples), ".RE", ".fi"]
    every = [*options, *global_options()] if path else global_options()
    lines.append(".SH FILES")
    for name, why in sorted(files_of(every).items()):
        lines += [".TP", f"\\fI{roff(name)}\\fR", roff(why)]
    lines.append(".SH ENVIRONMENT")
    for name, why in sorted(environment_of(every).items()):
        lines += [".TP", f"\\fB{name}\\fR", roff(why)]
    lines.append(".SH SEE ALSO")
    pages = [f"\\fB{roff(page_name(p))}\\fR(1)" for p in see_also(path, command)]
    lines.append(",\n".join(pages))
    return "\n".join(lines) + "\n"


def generate(target: Path) -> list[Path]:
    """Every page under ``target`` (created), sorted."""
    target.mkdir(parents=True, exist_ok=True)
    main.load_all()  # the top group loads its command modules lazily
    examples = guide_examples(GUIDE.read_text())
    for path, command in commands():
        page = target / f"{page_name(path)}.1"
        page.write_text(render(path, command, examples_of(path, examples)))
    return sorted(target.glob("*.1"))


if __name__ == "__main__":
    for page in generate(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)):
        print(page)
