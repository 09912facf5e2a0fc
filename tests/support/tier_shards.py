"""Which of the kernel tier's tests one guest runs, when ``make test-kernel`` boots several.

The tier runs under TCG, one vCPU per guest, and is bound by the host's CPU: two guests side by
side on two cores finish in about half the time of one. Each guest gets ``vmlend.shard=K/N`` on
its kernel command line (kernel-tier/boot.sh) and keeps the tests of shard K.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Tests known to run far longer than the rest under TCG (seconds, from the tier's
#: ``--durations``): dealt out first so that no shard gets two of them. Anything else counts
#: as one unit; a missing or stale entry only costs balance, never a test.
HEAVY = {
    "test_takeback_kernel.py::": 90,
    "test_vm_kernel.py::": 35,
}
LIGHT = 10


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
