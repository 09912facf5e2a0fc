"""``make deb`` names the package by debian/changelog's version (docs/packaging.md): it must be
vmlend's own, or the package would say one version and ``vmlend --version`` another."""

from __future__ import annotations

import re

from tests.support.paths import REPO
from vmlend import __version__


def test_the_changelog_version_is_the_package_version():
    first = (REPO / "debian" / "changelog").read_text().splitlines()[0]
    match = re.match(r"vmlend \(([^)]+)\) bookworm;", first)
    assert match, first
    assert match.group(1) == __version__
