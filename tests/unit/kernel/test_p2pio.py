"""Writing a child's ``p2p`` and reading its peer-to-peer files (docs/smartio-contract.md
section 8): each refusal of the driver becomes the error the section's table names, and
``ENOTCONN``/``EAGAIN`` are no error at all."""

# ruff: noqa: F811 (the imported fixtures are parameters of the tests)

from __future__ import annotations

import errno

import pytest

from tests.support.p2p_host import BARS_B, GPU_A, GPU_B, UA, UB, p2p, token, web  # noqa: F401
from tests.support.smartio_host import WEB, fabric, fake, state  # noqa: F401
from vmlend.errors import (
    BarConflictError,
    FabricError,
    P2PError,
    ResourceExhaustedError,
    StaleTokenError,
    UnknownDeviceError,
)
from vmlend.kernel.p2pfiles import P2PLine
from vmlend.kernel.p2pio import P2PFiles, Written
from vmlend.topology.model import GiB, GuestRange

BAR1 = P2PLine(GPU_B, 1, BARS_B[1], 32 * GiB)
BAR0 = P2PLine(GPU_B, 0, BARS_B[0], 16 << 20)


@pytest.fixture
def files(fake):
    return P2PFiles(fake.env, fake)


@pytest.fixture
def decoded(fabric, web):
    web.decode(UB, BARS_B, announce=False)
    return token(fabric, GPU_A)


def test_an_accepted_write_reads_back_with_its_state(files, decoded, web):
    assert files.write(GPU_A, UA, decoded, [BAR0, BAR1]).outcome is Written.WRITTEN
    report = files.report(UA, GPU_A)
    assert report is not None and report.damaged == ""
    assert report.written is not None and report.written.token == decoded
    assert report.written.lines == (BAR0, BAR1)
    assert [s.line for s in report.state] == [BAR0, BAR1]
    assert {s.case for s in report.state} == {"other-lender"}
    assert [(b.index, b.gpa) for b in files.guest_bars(UB, GPU_B) or ()] == sorted(
        BARS_B.items()
    )
    assert files.write(GPU_A, UA, decoded, []).outcome is Written.WRITTEN  # token alone
    assert web.written(UA) == []


@pytest.mark.parametrize(
    ("lines", "error", "words"),
    [
        ([P2PLine(GPU_A, 0, 0xC000_0000, 16 << 20)], FabricError, "EINVAL"),  # its own fdid
        ([P2PLine(GPU_B, 1, BARS_B[1], 16 * GiB)], FabricError, "EINVAL"),  # wrong size
        ([P2PLine(GPU_B, 2, 0xC000_0000, 16 << 20)], FabricError, "EINVAL"),  # no BAR 2
        ([P2PLine(GPU_B, 0, 0xC000_1000, 16 << 20)], FabricError, "EINVAL"),  # misaligned
        ([P2PLine(GPU_B, 0, 0x1_0000_0000, 16 << 20)], FabricError, "EINVAL"),  # mem32 > 4G
        ([P2PLine(0x99, 0, 0xC000_0000, 16 << 20)], UnknownDeviceError, "0x99"),
        ([P2PLine(GPU_B, 1, 1 << 41, 32 * GiB)], P2PError, "ERANGE"),  # 0x10 has 40 bits
        ([P2PLine(GPU_B, 0, 0, 16 << 20)], BarConflictError, "DMA window"),  # over RAM
    ],
)
def test_a_refused_write_is_the_contracts_error(files, decoded, web, lines, error, words):
    with pytest.raises(error, match=words) as e:
        files.write(GPU_A, UA, decoded, lines, [GuestRange(0, 2 * GiB)])
    assert not isinstance(e.value, P2PError) or error is not FabricError
    assert web.written(UA) == []


def test_two_lines_over_one_another_are_a_bar_conflict(files, decoded, fake):
    fake.smartio.devs[0x11].borrower = fake.smartio.node_id
    over = P2PLine(0x11, 0, BARS_B[0], 16 << 20)
    conflict = r"BAR 0 of device 0x20 .* over the map to 0x11/bar0"
    with pytest.raises(BarConflictError, match=conflict):
        files.write(GPU_A, UA, decoded, [BAR0, over])


def test_an_older_token_is_stale(files, decoded, fake):
    fake.write(fake.env.smartio / "smartio-10" / "token", str(decoded + 5))
    with pytest.raises(StaleTokenError, match=f"newer hold \\(token {decoded + 5}\\)"):
        files.write(GPU_A, UA, decoded, [BAR1])


def test_a_target_of_another_vm_is_exdev(files, decoded, web):
    web.containers[UB] = "another VM's container"
    with pytest.raises(P2PError, match="EXDEV"):
        files.write(GPU_A, UA, decoded, [BAR1])


def test_no_free_segment_is_resource_exhausted(files, decoded, web):
    web.full = True
    with pytest.raises(ResourceExhaustedError, match="lender adapter of device 0x10"):
        files.write(GPU_A, UA, decoded, [BAR1])


def test_not_borrowed_or_not_decoded_waits(files, decoded, fake, web):
    moved = P2PLine(GPU_B, 1, 0xA0_0000_0000, 32 * GiB)
    result = files.write(GPU_A, UA, decoded, [moved])
    assert result.outcome is Written.WAIT and "moved a BAR" in result.detail  # EAGAIN
    fake.smartio.guest_release(GPU_B)
    result = files.write(GPU_A, UA, decoded, [BAR1])
    assert result.outcome is Written.WAIT and "not borrowed" in result.detail  # ENOTCONN
    assert web.written(UA) == []


def test_a_driver_without_the_files_is_told_apart(files, fabric, fake, web):
    fake.smartio.data_path = False
    fabric.reserve(0x12, WEB)
    fabric.ensure_mdev_parent(0x12)
    uuid = "83b8f4f2-509f-382f-3c1e-e6bfe0fa2003"
    fabric.create_mdev(0x12, uuid, WEB)
    assert files.write(0x12, uuid, 1, []).outcome is Written.NO_GROUP
    assert files.report(uuid, 0x12) is None
    assert files.guest_bars(uuid, 0x12) is None and files.state(uuid) is None


def test_a_damaged_file_is_a_damaged_report(files, web):
    (web.children[UA].group / "p2p_state").write_text("0x20 1 0x0 0x1000 sideways - -\n")
    report = files.report(UA, GPU_A)
    assert report is not None and "unknown case" in report.damaged


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("0x20 1 0x0 0x1000\n", errno.EINVAL),  # no token line
        ("token 1\n0x20 1 0x0\n", errno.EINVAL),
        ("token 1\n" + "0x20 0 0xc1000000 0x1000000\n" * 65, errno.E2BIG),
    ],
)
def test_the_fake_refuses_what_vmlend_never_writes(fake, web, text, code):
    """Writes ``format_p2p`` cannot make, straight to the fake's ``p2p``."""
    with pytest.raises(OSError) as e:
        fake.write(web.children[UA].group / "p2p", text)
    assert e.value.errno == code
