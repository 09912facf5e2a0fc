"""Which of the kernel tier's tests one guest runs, when ``make test-kernel`` boots several.

The tier runs under TCG, one vCPU per guest, and is bound by the host's CPU: two guests side by
side on two cores finish in about half the time of one. Each guest gets ``vmlend.shard=K/N`` on
its kernel command line (kernel-tier/boot.sh) and keeps the tests of shard K.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Seconds the tier's tests took under TCG on an idle machine (``--durations``, on 2026-11-29),
#: without the session's libvirtd and etcd start-up, which every guest pays once whatever it
#: runs, for the tests that take more than a few: dealt out first, each to the shard with the
#: least so far. A key is a part of a test's id; anything else counts ``LIGHT``. A missing or
#: stale entry costs only balance, never a test. (Weights from a loaded run put the two
#: guests' pytest at 198 and 178 s idle: a slow test is not slower by the same factor.)
HEAVY = {
    "test_a_fenced_device_is_taken_back_by_the_lenders_agent": 45,
    "test_two_vms_asking_for_the_last_instance": 26,
    "serves_libvirtds_hook[etcd]": 25,
    "test_a_started_vms_child_has_the_guests_ram_as_windows": 24,
    "test_a_live_detach_the_guest_never_acknowledges": 18,
    "test_a_vm_made_by_xml_new_runs_and_stops": 18,
    "test_libvirtd_restarted_under_a_running_vm": 17,
    "test_a_vm_starts_gets_a_device_hot_added": 12,
    "serves_libvirtds_hook[sqlite]": 10,
    "test_the_watcher_writes_a_recreated_childs_windows": 9,
    "test_libvirtd_starts_a_domain_with_the_mdev_hostdev": 8,
    "test_the_installed_command_works_too": 7,
    "test_the_watcher_brings_back_a_running_vms_mdev": 7,
    "test_a_returning_lender_gets_the_running_vms_mdev_back": 6,
    "test_the_watcher_writes_each_sources_p2p": 6,
    "the_interrupts_a_vfio_device_raises_to_the_vmms_eventfds[intx]": 5,
    "the_interrupts_a_vfio_device_raises_to_the_vmms_eventfds[msi]": 5,
    "test_fabric_discover_merges_this_host_from_the_stand_in": 5,
    "test_doctor_notices_the_parent_driver_unloaded": 4,
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
