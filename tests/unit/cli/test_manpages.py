"""The man pages in docs/man are the commands' own help, rendered (``make man``): one page per
command and group, and none that a command no longer has; each with its whole NAME, examples
from the user guide, the files and variables its options name, and pages to go on to."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess

from tests.support.needs import need
from tests.support.paths import REPO
from vmlend.cli import COMMANDS, main

MAN = REPO / "docs" / "man"
SECTIONS = ("NAME", "SYNOPSIS", "DESCRIPTION", "EXAMPLES", "FILES", "ENVIRONMENT", "SEE ALSO")


def _generator():
    spec = importlib.util.spec_from_file_location("generate_man", MAN / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generate(target):
    return _generator().generate(target)


def _body(text: str) -> str:
    return re.sub(r'^(\.TH "[^"]*" "1") "[^"]*"', r"\1", text, count=1)  # the date aside


def test_the_pages_match_the_commands(tmp_path):
    fresh = {p.name: _body(p.read_text()) for p in _generate(tmp_path)}
    kept = {p.name: _body(p.read_text()) for p in MAN.glob("*.1")}
    assert sorted(fresh) == sorted(kept), "run 'make man'"
    stale = [name for name in fresh if fresh[name] != kept[name]]
    assert stale == [], f"run 'make man': {stale}"


def test_every_command_has_a_page(tmp_path):
    main.load_all()
    names = {p.name for p in _generate(tmp_path)}
    for name, command in main.commands.items():
        assert f"vmlend-{name}.1" in names
        for sub in getattr(command, "commands", {}):
            assert f"vmlend-{name}-{sub}.1" in names


def _sections(text: str) -> dict[str, list[str]]:
    """A page's sections, each its lines (roff as written)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith(".SH "):
            current = line[4:].strip('"')
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


#: The escapes vmlend's pages use, and what a reader sees for each.
_ESCAPES = (("\\-", "-"), ("\\e", "\\"), ("\\&", ""), ("\\fB", ""), ("\\fR", ""), ("\\fI", ""))


def _plain(roff: str) -> str:
    """A line of roff as a reader sees it."""
    for escape, text in _ESCAPES:
        roff = roff.replace(escape, text)
    return roff


def _pages() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(MAN.glob("*.1"))}


def _paths() -> dict[str, tuple[str, ...]]:
    """Each page's command path (subcommand names hold hyphens too: link-down)."""
    main.load_all()
    generator = _generator()
    return {f"{generator.page_name(p)}.1": p for p, _ in generator.commands()}


def test_no_name_is_cut_and_each_is_the_commands_first_sentence():
    pages, paths = _pages(), _paths()
    assert sorted(pages) == sorted(paths) and len(pages) >= 56
    for name, text in pages.items():
        (line,) = _sections(text)["NAME"]
        summary = _plain(line).partition(" - ")[2]
        assert not summary.endswith("..."), name
        assert len(summary) > 20 and not summary.endswith("."), name
        path = paths[name]
        if len(path) == 1:  # vmlend --help's summary, which is the docstring's first sentence
            assert summary + "." == COMMANDS[path[0]][1], name
    # the longest summaries are whole, where click-man cut them at 45 characters
    (status,) = _sections(pages["vmlend-status.1"])["NAME"]
    assert _plain(status).endswith("per switch port in use its requester entries")


def test_every_page_has_the_sections_a_reader_looks_for():
    for name, text in _pages().items():
        sections = _sections(text)
        missing = [s for s in SECTIONS if not [ln for ln in sections.get(s, []) if ln.strip()]]
        assert missing == [], f"{name} lacks {missing}"


def test_examples_are_the_user_guides_and_run_the_pages_command():
    guide = (REPO / "docs" / "user-guide.md").read_text()
    generator, paths = _generator(), _paths()
    for name, text in _pages().items():
        examples = [_plain(ln) for ln in _sections(text)["EXAMPLES"] if not ln.startswith(".")]
        assert examples, name
        path = paths[name]
        for line in examples:
            assert line in guide, (name, line)
            ran = generator.command_at(shlex.split(line)[1:])
            assert ran[: len(path)] == path, (name, line)


def test_files_and_environment_come_from_the_options_help():
    attach = _sections(_pages()["vmlend-attach.1"])
    files = [_plain(ln) for ln in attach["FILES"] if ln.startswith("\\fI")]
    assert files == ["/etc/vmlend/vmlend.toml", "/var/lib/vmlend/state.db"]
    env = [_plain(ln) for ln in attach["ENVIRONMENT"] if ln.startswith("\\fB")]
    # -c's help names $LIBVIRT_DEFAULT_URI; every command takes the global options' variables
    assert {"LIBVIRT_DEFAULT_URI", "VMLEND_STATE", "VMLEND_CONFIG", "VMLEND_ROOT"} <= set(env)
    install = _sections(_pages()["vmlend-hook-install.1"])
    assert "\\fI/etc/libvirt\\fR" in install["FILES"]
    assert "\\fBVMLEND_HOOK_SOCKET\\fR" in install["ENVIRONMENT"]


def test_see_also_names_pages_that_exist():
    pages = _pages()
    for name, text in pages.items():
        refs = re.findall(r"\\fB(\S+?)\\fR\(1\)", "\n".join(_sections(text)["SEE ALSO"]))
        assert refs, name
        for ref in refs:
            assert _plain(ref) + ".1" in pages, (name, ref)
    assert "\\fBvmlend\\-detach\\fR(1)" in _sections(pages["vmlend-attach.1"])["SEE ALSO"]


def test_groff_renders_every_page_without_a_warning():
    need(shutil.which("groff") is not None, "groff (apt install groff) renders man pages")
    for page in sorted(MAN.glob("*.1")):
        r = subprocess.run(
            ["groff", "-man", "-Tutf8", "-ww", "-z", str(page)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert r.returncode == 0 and r.stderr == "", (page.name, r.stderr)
