"""Which host this is and that it runs one agent (``vmlend.agent.identity``): the machine-id,
the node binding's rule, the host's agent lock."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.hostroot import identify
from vmlend.agent.identity import Binding, HostLock, decide, machine_id
from vmlend.errors import AgentIdentityError, AgentRunningError
from vmlend.hostenv import HostEnv
from vmlend.registry.session import HostKey, NodeBinding

ME, OTHER = "a" * 32, "b" * 32


def test_the_machine_id_is_read_under_the_root_and_a_missing_or_bad_one_is_refused(tmp_path):
    env = HostEnv(tmp_path)
    with pytest.raises(AgentIdentityError, match=r"cannot read this host's identity .*machine-id"):
        machine_id(env)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "machine-id").write_text("uninitialized\n")
    with pytest.raises(AgentIdentityError, match="is not a machine-id"):
        machine_id(env)
    identify(tmp_path, machine_id=ME)
    assert machine_id(env) == ME


@pytest.mark.parametrize(
    ("bound", "alive", "own", "take_over", "verdict"),
    [
        (None, None, None, False, Binding.BIND),  # a new node
        (NodeBinding(""), None, None, False, Binding.BIND),  # an older vmlend's marker
        (NodeBinding(ME), None, None, False, Binding.OURS),
        (NodeBinding(ME), HostKey(lease=5), 5, False, Binding.OURS),  # our previous agent's
        (NodeBinding(OTHER), None, None, True, Binding.TAKE_OVER),  # its lease has expired
    ],
)
def test_a_node_is_bound_to_one_host(bound, alive, own, take_over, verdict):
    assert decide("gamma", ME, bound, alive, own, take_over=take_over) is verdict


def test_another_hosts_node_is_refused_unless_taken_over_and_never_while_its_agent_lives():
    with pytest.raises(AgentIdentityError, match=f"belongs to the host with machine-id {OTHER}"):
        decide("gamma", ME, NodeBinding(OTHER), None, None, take_over=False)
    alive = HostKey(lease=9, pid=42, machine_id=OTHER)
    with pytest.raises(AgentIdentityError, match=f"served by an agent on machine-id {OTHER}"):
        decide("gamma", ME, NodeBinding(OTHER), alive, None, take_over=True)
    # a clone of this host (same machine-id) whose agent lives on a lease that is not ours
    with pytest.raises(AgentIdentityError, match="lease 9"):
        decide("gamma", ME, NodeBinding(ME), HostKey(lease=9, machine_id=ME), 5, take_over=False)


def test_a_host_runs_one_agent_whatever_its_socket(tmp_path):
    lock = HostLock.of(HostEnv(tmp_path))
    lock.acquire()
    try:
        code = (
            "import sys; from pathlib import Path; from vmlend.agent.identity import HostLock\n"
            "from vmlend.errors import AgentRunningError\n"
            "l = HostLock(Path(sys.argv[1]))\n"
            "print(l.held_elsewhere())\n"
            "try:\n    l.acquire()\nexcept AgentRunningError as e:\n    print(e)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(lock.path)], capture_output=True, text=True
        ).stdout.splitlines()
        assert out[0] == "True"
        assert f"another vmlend agent runs on this host (pid {os.getpid()})" in out[1]
    finally:
        lock.release()
    assert not HostLock(lock.path).held_elsewhere()
    second = HostLock(lock.path)
    second.acquire()  # free again once the first let go
    second.release()
    with pytest.raises(AgentRunningError):
        lock.acquire()
        HostLock(lock.path).acquire()
    lock.release()
