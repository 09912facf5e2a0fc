"""Which fabric the agent runs a served hook call on (``vmlend.hook.server.identity_of``): the
one the hook process would have opened in-process, backend included."""

from __future__ import annotations

from vmlend.hook.server import identity_of


def env(tmp_path, **extra: str) -> dict[str, str]:
    return {"VMLEND_STATE": str(tmp_path / "state.db"), "VMLEND_ROOT": str(tmp_path), **extra}


def test_an_unpinned_backend_is_the_hosts_smartio_where_the_driver_is_loaded(tmp_path):
    """A hook installed without a backend opens the host's: smartio when the driver's node_id
    is under the root. The agent serving it must run it there too, not on the simulator
    (the kernel tier found VM starts failing: the mdev was made in the simulator only)."""
    assert identity_of(env(tmp_path)).backend == "sim"  # no driver under this root
    smartio = tmp_path / "sys" / "class" / "smartio"
    smartio.mkdir(parents=True)
    (smartio / "node_id").write_text("12\n")
    assert identity_of(env(tmp_path)).backend == "smartio"
    assert identity_of(env(tmp_path, VMLEND_BACKEND="sim")).backend == "sim"  # pinned wins
