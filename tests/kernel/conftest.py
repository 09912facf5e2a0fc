"""The kernel tier: these tests run inside the guest that ``make test-kernel`` boots (Debian's
6.1 kernel under QEMU with an emulated Intel IOMMU, VFIO, the mdev core and the kernel's mtty
sample parent loaded; kernel-tier/). Every test here is marked ``kernel`` and starts and ends
with no mdev on the real sysfs."""

from __future__ import annotations

import pytest

from tests.support.kernel_guest import remove_all_mdevs


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.kernel)


@pytest.fixture(autouse=True)
def no_mdevs_left():
    remove_all_mdevs()
    yield
    remove_all_mdevs()
