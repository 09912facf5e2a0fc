"""Shell completion of device ids, node names and VM names from the fabric and the hypervisor,
and nothing (never an error, never a line on the terminal) when they cannot be read."""

from __future__ import annotations

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
