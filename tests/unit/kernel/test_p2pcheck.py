"""``vmlend doctor``'s peer-to-peer check: each child's ``guest_bars``, ``p2p`` and
``p2p_state`` for themselves (docs/smartio-contract.md section 8), one line per problem."""

# ruff: noqa: F811 (the imported fixtures are parameters of the tests)

from __future__ import annotations

from tests.support.p2p_host import BARS_A, BARS_B, UA, UB, p2p, web  # noqa: F401
from tests.support.smartio_host import fabric, fake, start_vm, state  # noqa: F401
from vmlend.doctor import Status, check_p2p
from vmlend.kernel.p2psync import P2PSync


def _mapped(fabric, fake, web):
    fake.listeners.append(P2PSync(fabric).handle)
    web.decode(UA, BARS_A)
    web.decode(UB, BARS_B)


def test_no_child_no_check(fake):
    assert check_p2p(fake.env) is None


def test_a_driver_without_the_files_is_the_data_path_checks(fabric, fake):
    fake.smartio.data_path = False
    start_vm(fabric)
    assert check_p2p(fake.env) is None


def test_maps_to_decoded_bars_pass(fabric, fake, web):
    _mapped(fabric, fake, web)
    f = check_p2p(fake.env)
    assert f is not None and f.status is Status.OK
    assert f.detail == "2 children: 6 peer-to-peer map(s), each to a BAR the guest decodes"


def test_a_map_the_driver_kept_for_a_bar_gone_is_named(fabric, fake, web):
    _mapped(fabric, fake, web)
    c = web.children[UB]
    c.decoded = {}  # a driver that did not drop the maps when decoding went off
    web._sync(c)
    f = check_p2p(fake.env)
    assert f is not None and f.status is Status.WARN
    assert f.detail.startswith(
        f"mdev {UA} (device 0x10) keeps a peer-to-peer map to 0x20/bar0 at"
        " 0xc1000000+0x1000000, which no child of 0x20 decodes there"
    )
    assert f.detail.endswith("(and 2 more)")


def test_files_that_disagree_or_are_damaged_are_named(fabric, fake, web):
    _mapped(fabric, fake, web)
    group = web.children[UA].group
    (group / "p2p").write_text("token 1\n")
    f = check_p2p(fake.env)
    assert f is not None and "p2p reads back 0 map(s), p2p_state lists 3" in f.detail
    (group / "p2p_state").write_text("garbage\n")
    f = check_p2p(fake.env)
    assert f is not None and f.status is Status.WARN and "p2p_state" in f.detail
