"""Which of the kernel tier's tests one guest runs, when ``make test-kernel`` boots several.

The tier runs under TCG, one vCPU per guest, and is bound by the host's CPU: two guests side by
side on two cores finish in about half the time of one. Each guest gets ``vmlend.shard=K/N`` on
its kernel command line (kernel-tier/boot.sh) and keeps the tests of shard K.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Seconds the tier's tests took under TCG (``--durations=0``, setup and teardown included, on
#: 2026-11-29), for the tests that take more than a few: dealt out first, each to the shard
#: with the least so far. A key is a part of a test's id; anything else counts ``LIGHT``. A
#: missing or stale entry costs only balance, never a test.
HEAVY = {
    "test_a_fenced_device_is_taken_back_by_the_lenders_agent": 112,
    "serves_libvirtds_hook[etcd]": 55,
    "test_a_live_detach_the_guest_never_acknowledges": 41,
    "test_libvirtd_restarted_under_a_running_vm": 36,
    "serves_libvirtds_hook[sqlite]": 34,
    "test_two_vms_asking_for_the_last_instance": 34,
    "test_a_started_vms_child_has_the_guests_ram_as_windows": 30,
    "test_a_vm_starts_gets_a_device_hot_added": 24,
    "test_a_vm_made_by_xml_new_runs_and_stops": 22,
    "test_libvirtd_starts_a_domain_with_the_mdev_hostdev": 16,
    "test_the_watcher_writes_a_recreated_childs_windows": 10,
    "test_the_watcher_writes_each_sources_p2p": 9,
    "test_the_watcher_brings_back_a_running_vms_mdev": 8,
    "test_the_installed_command_works_too": 7,
    "test_a_returning_lender_gets_the_running_vms_mdev_back": 6,
}
LIGHT = 2


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` (1 ≤ K ≤ N) as ``(K, N)``; ValueError for anything else."""
    k_text, sep, n_text = text.partition("/")
    if not sep:
        raise ValueError(f"shard {text!r} is not K/N")
    k, n = int(k_text), int(n_text)
    if not 1 <= k <= n:
        raise ValueError(f"shard {text!r} is not K/N with 1 <= K <= N")
    return k, n


def weight(nodeid: str) -> int:
    return next((w for key, w in HEAVY.items() if key in nodeid), LIGHT)


def shard_of(nodeids: Sequence[str], k: int, n: int) -> list[str]:
    """The tests shard ``k`` of ``n`` runs, in collection order: every test in exactly one
    shard, dealt heaviest first to the lightest shard so far (ties: collection order, then the
    lowest shard), so every guest computes the same split on its own."""
    loads = [0] * n
    owner: dict[str, int] = {}
    for nodeid in sorted(nodeids, key=lambda i: -weight(i)):  # stable: collection order kept
        s = loads.index(min(loads))
        owner[nodeid] = s
        loads[s] += weight(nodeid)
    return [i for i in nodeids if owner[i] == k - 1]
