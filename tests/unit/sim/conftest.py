"""The simulated cluster every test here runs on (``tests/support/simcluster.py``): it
overrides, for this directory, the CLI cluster fixture of the same name."""

from __future__ import annotations

import pytest

from tests.support.simcluster import Cluster


@pytest.fixture
def cluster(state_path):
    c = Cluster.create(state_path)
    yield c
    c.close()
