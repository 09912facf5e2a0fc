"""Shell completion of device ids, node names and VM names from the fabric and the hypervisor,
and nothing (never an error, never a line on the terminal) when they cannot be read."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from click.shell_completion import ShellComplete

from vmlend.cli import main


def _complete(args: list[str], incomplete: str) -> list[tuple[str, str | None]]:
    main.load_all()
    comp = ShellComplete(main, {}, "vmlend", "_VMLEND_COMPLETE")
    return [(c.value, c.help) for c in comp.get_completions(args, incomplete)]


def test_device_ids_complete_with_kind_lender_and_state(cluster):
    cluster.define("gamma", "web", [0x20], running=True)
    got = dict(_complete(["--state", str(cluster.state_path), "lend"], "0x2"))
    assert set(got) == {"0x20", "0x21", "0x22", "0x23", "0x24", "0x25"}
    assert got["0x20"] == "gpu on beta, reserved by gamma/web"
    assert got["0x21"] == "nic on beta, available"
    # The same for every option that takes a device, e.g. xml new --device
    args = ["--state", str(cluster.state_path), "xml", "new", "vm2", "--device"]
    assert [v for v, _ in _complete(args, "0x1")] == ["0x10", "0x11", "0x12"]


def test_vm_names_come_from_the_hypervisor_with_virshs_state_words(cluster):
    cluster.define("gamma", "web", [0x20], running=True)
    cluster.define("gamma", "idle", [0x21])
    args = ["--state", str(cluster.state_path), "-c", "sim:///gamma", "attach"]
    assert sorted(_complete(args, "")) == [("idle", "shut off"), ("web", "running")]
    assert _complete(args, "w") == [("web", "running")]


def test_nothing_to_read_completes_nothing_and_says_nothing(tmp_path, capfd):
    missing = str(tmp_path / "none" / "state.db")
    assert _complete(["--state", missing, "lend"], "") == []
    assert _complete(["--state", missing, "-c", "sim:///gamma", "attach"], "") == []
    out, err = capfd.readouterr()
    assert out == err == ""


def test_node_names_complete_wherever_a_node_is_asked_for(cluster):
    state = ["--state", str(cluster.state_path)]
    assert _complete([*state, "fabric", "node-down"], "") == [
        ("alpha", "alpha.fabric.local"),
        ("beta", "beta.fabric.local"),
        ("gamma", "gamma.fabric.local"),
    ]
    assert [v for v, _ in _complete([*state, "nvme", "reserve", "0x12", "web", "--node"], "g")] == [
        "gamma"
    ]
    assert [v for v, _ in _complete([*state, "nvme", "share"], "0x1")] == ["0x10", "0x11", "0x12"]


def _bash(words: list[str], line: str) -> list[str]:
    """What bash offers: the script ``bash_source`` prints, its function run on ``words`` as
    bash splits them (at ':' too, COMP_WORDBREAKS' default) for the command ``line``."""
    vmlend = Path(sys.executable).parent / "vmlend"
    script = "\n".join(
        [
            f'eval "$(_VMLEND_COMPLETE=bash_source {shlex.quote(str(vmlend))})"',
            f"COMP_LINE={shlex.quote(line)}",
            "COMP_POINT=${#COMP_LINE}",
            "COMP_WORDS=(" + " ".join(shlex.quote(w) for w in words) + ")",
            f"COMP_CWORD={len(words) - 1}",
            f"_vmlend_completion {shlex.quote(str(vmlend))}",
            'printf "%s\\n" "${COMPREPLY[@]}"',
        ]
    )
    r = subprocess.run(
        ["bash", "--norc", "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return sorted(r.stdout.split())


def test_bash_completes_vm_names_after_a_uri_with_colons(cluster):
    """``vmlend -c sim:///gamma attach <Tab>``: bash hands the words split at ':'; click alone
    read '-c sim' and a stray ':' and offered subcommands."""
    cluster.define("gamma", "web", [0x20], running=True)
    cluster.define("gamma", "idle", [0x21])
    state = str(cluster.state_path)
    line = f"vmlend --state {state} -c sim:///gamma attach "
    words = ["vmlend", "--state", state, "-c", "sim", ":", "///gamma", "attach", ""]
    assert _bash(words, line) == ["idle", "web"]
    assert _bash([*words[:-1], "w"], line + "w") == ["web"]
    # a word with a ':' being typed: bash replaces what follows the ':' only
    assert _bash(["vmlend", "-c", "sim", ":"], "vmlend -c sim:") == []


def test_a_name_with_a_control_character_is_never_offered():
    """Each item is a line of the shell function's input: a VM named 'x\\nplain,forged' would
    offer a 'forged' item of its own making."""
    from click.shell_completion import CompletionItem

    from vmlend.cli import complete

    def found(ctx, incomplete):
        return [CompletionItem("web"), CompletionItem("x\nplain,forged"), CompletionItem("a\tb")]

    guarded = complete._guarded(found)
    assert [i.value for i in guarded(None, None, "")] == ["web"]


def test_a_word_with_a_colon_is_answered_with_what_bash_replaces(monkeypatch):
    """Bash replaces only what follows the word's last ':' when ':' breaks words; with ':'
    taken out of COMP_WORDBREAKS it replaces the whole word."""
    import click

    from vmlend.cli.bashcomplete import LineBashComplete

    @click.command()
    @click.option("-c", shell_complete=lambda c, p, i: ["qemu:///system", "qemu:///session"])
    def cmd(c: str | None) -> None: ...

    line = "prog -c qemu:///s"
    monkeypatch.setenv("COMP_LINE", line)
    monkeypatch.setenv("COMP_POINT", str(len(line)))
    comp = LineBashComplete(cmd, {}, "prog", "_PROG_COMPLETE")
    monkeypatch.setenv("COMP_WORDBREAKS", " \t\n\"'><=;|&(:")
    args, incomplete = comp.get_completion_args()
    assert (args, incomplete) == (["-c"], "qemu:///s")
    values = [i.value for i in comp.get_completions(args, incomplete)]
    assert values == ["///system", "///session"]
    monkeypatch.setenv("COMP_WORDBREAKS", " \t\n\"'><=;|&(")
    values = [i.value for i in comp.get_completions(args, incomplete)]
    assert values == ["qemu:///system", "qemu:///session"]
