"""kernel-tier/resolve.py: which version of each package `make test-kernel` fetches, decided on
apt-cache outputs recorded from Debian's archive (tests/data/kernel_tier/README.md): only the
kernel's ABI is pinned to the image's version, the rest follows the headers' Depends and what
the archive offers, and a misfit is one line naming the package, the constraint and the
versions the archive has."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence

import pytest

from tests.support.kernel_tier import load
from tests.support.paths import DATA

resolve = load("resolve")

NEWER = "newer-2026-11-28"  # image 6.1.192-2, kbuild and compiler only 6.1.192-3
EXACT = "exact-2026-11-28"  # image 6.1.176-1, everything at 6.1.176-1 too


class Archive:
    """apt-cache answering from one recording; it remembers what it was asked."""

    def __init__(self, recording: str) -> None:
        d = DATA / "kernel_tier" / recording
        self.depends = (d / "depends.txt").read_text()
        self.policy = (d / "policy.txt").read_text()
        self.show = (d / "show-headers.txt").read_text()
        self.asked: list[list[str]] = []

    def edit(self, field: str, old: str, new: str) -> Archive:
        text = getattr(self, field)
        assert text.count(old) == 1, f"{old!r} is not once in the recorded {field}"
        setattr(self, field, text.replace(old, new))
        return self

    def drop(self, package: str, *versions: str) -> Archive:
        """Take ``versions`` (their rows and the source rows under them) out of ``package``'s
        version table in the policy."""
        out, section, skipping = [], None, False
        for line in self.policy.splitlines(keepends=True):
            if not line.startswith(" "):
                section = line.rstrip(":\n")
            if line.startswith("     ") and line[5] != " ":  # a version row
                skipping = section == package and line.split()[-2] in versions
            elif not line.startswith("        "):  # not a source row under the version
                skipping = False
            if not skipping:
                out.append(line)
        assert len(out) < len(self.policy.splitlines()), f"{package} has none of {versions}"
        self.policy = "".join(out)
        return self

    def add(self, package: str, version: str, *, candidate: bool = False) -> Archive:
        """List ``version`` first (newest) in ``package``'s version table; ``candidate``: make
        it apt's candidate too."""
        start = self.policy.index(f"{package}:\n")
        head, table = self.policy[:start], self.policy[start:]
        if candidate:
            table = re.sub(r"(?m)^  Candidate: .*$", f"  Candidate: {version}", table, count=1)
        table = table.replace("  Version table:\n", f"  Version table:\n     {version} 500\n", 1)
        self.policy = head + table
        return self

    def __call__(self, args: Sequence[str]) -> str:
        self.asked.append(list(args))
        return {"depends": self.depends, "policy": self.policy, "show": self.show}[args[0]]


def _picks(plan) -> dict[str, str]:
    return {p.package: p.version for p in plan.picks}


KBUILD_MISFIT = (
    "linux-kbuild-6.1: nothing fits >= 6.1.192-2 (linux-headers-6.1.0-56-amd64 Depends); "
    "the archive has 6.1.176-1"
)


def test_exact_revisions_present_for_all_are_all_taken():
    """kbuild and the compiler are also at 6.1.192-3, the candidate: the bound takes the
    revision the headers were built with, the compiler (unversioned) apt's candidate."""
    plan = resolve.resolve(Archive(EXACT))
    assert (plan.krel, plan.kver) == ("6.1.0-50-amd64", "6.1.176-1")
    assert _picks(plan) == {
        "linux-image-6.1.0-50-amd64": "6.1.176-1",
        "linux-headers-6.1.0-50-amd64": "6.1.176-1",
        "linux-headers-6.1.0-50-common": "6.1.176-1",
        "linux-kbuild-6.1": "6.1.176-1",
        "linux-compiler-gcc-12-x86": "6.1.192-3",
        "linux-source-6.1": "6.1.176-1",
    }


def test_only_a_newer_revision_of_kbuild_and_the_compiler_is_taken_the_abi_stays_pinned():
    """Issue 34: the archive of 2026-11-28, where pinning everything to 6.1.192-2 failed."""
    plan = resolve.resolve(Archive(NEWER))
    assert (plan.krel, plan.kver) == ("6.1.0-56-amd64", "6.1.192-2")
    assert _picks(plan) == {
        "linux-image-6.1.0-56-amd64": "6.1.192-2",
        "linux-headers-6.1.0-56-amd64": "6.1.192-2",
        "linux-headers-6.1.0-56-common": "6.1.192-2",
        "linux-kbuild-6.1": "6.1.192-3",
        "linux-compiler-gcc-12-x86": "6.1.192-3",
        "linux-source-6.1": "6.1.192-2",
    }


def test_the_headers_stanza_asked_for_is_the_image_version_s():
    archive = Archive(NEWER)
    resolve.resolve(archive)
    assert ["show", "linux-headers-6.1.0-56-amd64=6.1.192-2"] in archive.asked


def test_kbuild_only_older_than_the_image_is_one_line_naming_it():
    archive = Archive(NEWER).drop("linux-kbuild-6.1", "6.1.192-3")
    with pytest.raises(resolve.NoFit) as e:
        resolve.resolve(archive)
    assert str(e.value) == KBUILD_MISFIT


def test_main_prints_the_misfit_as_one_line_and_nothing_for_fetch_to_source(monkeypatch, capsys):
    archive = Archive(NEWER).drop("linux-kbuild-6.1", "6.1.192-3")
    monkeypatch.setattr(resolve, "run_apt_cache", archive)
    assert resolve.main() == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"fetch: {KBUILD_MISFIT}\n")


def test_main_prints_what_fetch_sh_sources(monkeypatch, capsys):
    monkeypatch.setattr(resolve, "run_apt_cache", Archive(NEWER))
    assert resolve.main() == 0
    assert capsys.readouterr().out == (
        "SERIES=6.1\n"
        "KREL=6.1.0-56-amd64\n"
        "KVER=6.1.192-2\n"
        "DEBS='linux-image-6.1.0-56-amd64=6.1.192-2 linux-headers-6.1.0-56-amd64=6.1.192-2"
        " linux-headers-6.1.0-56-common=6.1.192-2 linux-kbuild-6.1=6.1.192-3"
        " linux-compiler-gcc-12-x86=6.1.192-3 linux-source-6.1=6.1.192-2'\n"
    )


def test_the_headers_stay_at_the_image_s_version_when_a_newer_one_is_the_candidate():
    archive = Archive(NEWER).add("linux-headers-6.1.0-56-amd64", "6.1.192-3", candidate=True)
    assert _picks(resolve.resolve(archive))["linux-headers-6.1.0-56-amd64"] == "6.1.192-2"


def test_the_common_headers_at_another_revision_do_not_fit():
    """The headers' Depends pin -common with `=`: a newer one is not taken."""
    archive = (
        Archive(NEWER)
        .drop("linux-headers-6.1.0-56-common", "6.1.192-2")
        .add("linux-headers-6.1.0-56-common", "6.1.192-3")
    )
    with pytest.raises(resolve.NoFit) as e:
        resolve.resolve(archive)
    assert str(e.value) == (
        "linux-headers-6.1.0-56-common: nothing fits = 6.1.192-2 "
        "(linux-headers-6.1.0-56-amd64 Depends); the archive has 6.1.192-3"
    )


def test_the_constraints_are_the_headers_own_depends():
    """Headers that asked for kbuild at exactly their version would not take 6.1.192-3."""
    archive = Archive(NEWER).edit(
        "show", "linux-kbuild-6.1 (>= 6.1.192-2)", "linux-kbuild-6.1 (= 6.1.192-2)"
    )
    with pytest.raises(resolve.NoFit) as e:
        resolve.resolve(archive)
    assert str(e.value) == (
        "linux-kbuild-6.1: nothing fits = 6.1.192-2 (linux-headers-6.1.0-56-amd64 Depends); "
        "the archive has 6.1.192-3, 6.1.176-1"
    )


def test_a_package_the_archive_lacks_is_named_with_none():
    archive = Archive(NEWER).edit(
        "show", ", linux-compiler-gcc-12-x86", ", linux-compiler-gcc-13-x86"
    )
    with pytest.raises(resolve.NoFit) as e:
        resolve.resolve(archive)
    assert str(e.value) == (
        "linux-compiler-gcc-13-x86: nothing fits any version "
        "(linux-headers-6.1.0-56-amd64 Depends); the archive has none"
    )


def test_the_first_alternative_that_fits_is_taken():
    archive = Archive(NEWER).edit(
        "show",
        ", linux-compiler-gcc-12-x86",
        ", linux-compiler-gcc-13-x86 | linux-compiler-gcc-12-x86",
    )
    picks = _picks(resolve.resolve(archive))
    assert picks["linux-compiler-gcc-12-x86"] == "6.1.192-3"
    assert "linux-compiler-gcc-13-x86" not in picks


def test_linux_source_without_the_image_s_revision_takes_the_newest_of_its_upstream_version():
    """Not the archive's newest: a 6.1.193 tree is another kernel's."""
    archive = (
        Archive(NEWER).drop("linux-source-6.1", "6.1.192-2").add("linux-source-6.1", "6.1.193-1")
    )
    assert _picks(resolve.resolve(archive))["linux-source-6.1"] == "6.1.192-3"


def test_linux_source_of_another_upstream_version_only_does_not_fit():
    archive = Archive(NEWER).drop("linux-source-6.1", "6.1.192-3", "6.1.192-2", "6.1.192-1")
    with pytest.raises(resolve.NoFit) as e:
        resolve.resolve(archive)
    assert str(e.value) == (
        "linux-source-6.1: nothing fits 6.1.192-2 or another revision of 6.1.192 "
        "(the image's version); the archive has 6.1.190-1, 6.1.187-1, 6.1.176-1, 6.1.170-3"
    )


def test_policy_lists_every_version_newest_first_and_reads_no_candidate_as_none():
    policy = resolve.parse_policy(
        (DATA / "kernel_tier" / NEWER / "policy.txt").read_text()
        + "nosuch:\n  Installed: (none)\n  Candidate: (none)\n  Version table:\n"
    )
    assert policy["linux-source-6.1"] == resolve.Available(
        "6.1.192-3",
        ("6.1.192-3", "6.1.192-2", "6.1.192-1", "6.1.190-1", "6.1.187-1", "6.1.176-1", "6.1.170-3"),
    )
    assert policy["nosuch"] == resolve.Available(None, ())


def test_debian_ordering_not_text_ordering():
    """6.1.192-10 is newer than 6.1.192-9, and ~ sorts before the release."""
    available = resolve.Available(None, ("6.1.192-9", "6.1.192-10", "6.1.192~rc1-1"))
    assert resolve.choose("k", (">=", "6.1.192-9"), available, "why") == "6.1.192-9"
    assert resolve.choose("k", (">>", "6.1.192-9"), available, "why") == "6.1.192-10"
    assert resolve.choose("k", None, available, "why") == "6.1.192-10"
    assert resolve.choose("k", ("<<", "6.1.192-1"), available, "why") == "6.1.192~rc1-1"


def test_an_unversioned_package_takes_apt_s_candidate_not_the_newest():
    """A pin (apt_preferences) may hold the candidate below the newest: apt-get install would
    take the candidate, so do we."""
    available = resolve.Available("6.1.192-2", ("6.1.192-3", "6.1.192-2"))
    assert resolve.choose("k", None, available, "why") == "6.1.192-2"


def test_a_metapackage_naming_no_6_1_image_is_one_line():
    archive = Archive(NEWER).edit(
        "depends", "linux-image-6.1.0-56-amd64", "linux-image-6.12.0-1-amd64"
    )
    with pytest.raises(resolve.NoFit) as e:
        resolve.resolve(archive)
    assert str(e.value) == (
        "linux-image-amd64 depends on no linux-image-6.1.*-amd64"
        " (apt-cache depends linux-image-amd64)"
    )


def test_a_failing_apt_cache_is_its_last_error_line(tmp_path, monkeypatch):
    fake = tmp_path / "apt-cache"
    fake.write_text('#!/bin/sh\necho "W: one" >&2\necho "E: the lists are locked" >&2\nexit 100\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(resolve.NoFit) as e:
        resolve.run_apt_cache(["policy", "linux-kbuild-6.1"])
    assert str(e.value) == "apt-cache policy linux-kbuild-6.1: E: the lists are locked"


def test_the_backports_series_release_is_read_in_its_newer_form():
    """6.12's packages name the release 6.12.N+debV-amd64, not 6.1's 6.1.0-N-amd64."""
    out = "linux-image-amd64\n  Depends: linux-image-6.12.95+deb12-amd64\n"
    assert resolve.kernel_release(out, "6.12") == "6.12.95+deb12-amd64"
    with pytest.raises(resolve.NoFit):
        resolve.kernel_release(out)  # not the 6.1 series


def test_main_refuses_an_argument_it_does_not_know(capsys):
    assert resolve.main(["--serie", "6.12"]) == 2
    assert "usage" in capsys.readouterr().err
