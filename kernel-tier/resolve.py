"""Which version of each Debian package the kernel tier fetches (issue 34).

Only the kernel's ABI must match: the image, its headers and what the headers' ``Depends:`` pin
with ``=`` (the ``-common`` tree) are taken at exactly the image's version; every other package
the headers depend on under the headers' own constraint (``linux-kbuild-6.1 (>= V)``, the
compiler unversioned); ``linux-source-6.1``, of which only ``samples/vfio-mdev/mtty.c`` is read,
at the image's version, else the newest revision of the same upstream version. Debian's archive
replaces packages under a fixed version (the image at 6.1.192-2 while kbuild and the compiler are
only at 6.1.192-3), so each choice is made among the versions apt-cache lists.

The decisions are pure functions of apt-cache's outputs (``apt-cache depends``, ``policy``,
``show``); :func:`resolve` asks apt-cache through the function it is given, and :func:`main` runs
the real one and prints the choice as sh assignments for fetch.sh, or one line naming what does
not fit (exit 1).

The backports tier (kernel-tier/backports/) asks the same questions of another series through
its private apt configuration (``APT_CONFIG``): ``--series 6.12``. Debian names that series'
releases ``6.12.N+debV-amd64`` where 6.1's are ``6.1.0-N-amd64``; both forms are read.

Usage: python resolve.py [--series S]   (prints SERIES=, KREL=, KVER=, DEBS= for fetch.sh)
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from debian.deb822 import Deb822, PkgRelation
from debian.debian_support import Version

SERIES = "6.1"
#: The metapackage whose candidate names the kernel's ABI (linux-image-6.1.0-N-amd64).
META = "linux-image-amd64"


def source_of(series: str) -> str:
    """The package that ships the series' tree as a tarball."""
    return f"linux-source-{series}"


SOURCE = source_of(SERIES)

#: A relation's version constraint as python-debian parses it: (operator, version), or None.
Constraint = tuple[str, str] | None
if TYPE_CHECKING:
    #: A Depends field: its alternatives, each a list of relations (name, version constraint...).
    Relations: TypeAlias = list[list[PkgRelation.ParsedRelation]]


class NoFit(Exception):
    """Nothing the archive offers fits: the message is the one line fetch.sh prints."""


@dataclass(frozen=True)
class Available:
    """One package in ``apt-cache policy``: its candidate and every version the archive lists."""

    candidate: str | None
    versions: tuple[str, ...]


@dataclass(frozen=True)
class Pick:
    package: str
    version: str


@dataclass(frozen=True)
class Plan:
    krel: str  # the kernel release, 6.1.0-N-amd64 (6.12.N+debV-amd64 for 6.12)
    kver: str  # the image's Debian version, V
    picks: tuple[Pick, ...]
    series: str = SERIES

    def shell(self) -> str:
        debs = " ".join(f"{p.package}={p.version}" for p in self.picks)
        pairs = (("SERIES", self.series), ("KREL", self.krel), ("KVER", self.kver), ("DEBS", debs))
        return "".join(f"{k}={shlex.quote(v)}\n" for k, v in pairs)


# --- parsing apt-cache's outputs (run with LC_ALL=C) ----------------------------------------

def _release_pattern(series: str) -> re.Pattern[str]:
    # 6.1.0-N-amd64 (bookworm's ABI names) or 6.12.N+debV-amd64 (since 6.10's packaging)
    return re.compile(
        rf"^\s*Depends: linux-image-({re.escape(series)}\.[0-9.]+(?:-\d+|\+deb\d+)-amd64)$", re.M
    )


def kernel_release(depends_out: str, series: str = SERIES) -> str:
    """The kernel release ``6.1.0-N-amd64`` that ``apt-cache depends linux-image-amd64`` names."""
    m = _release_pattern(series).search(depends_out)
    if m is None:
        raise NoFit(f"{META} depends on no linux-image-{series}.*-amd64 (apt-cache depends {META})")
    return m.group(1)


_SECTION = re.compile(r"^(\S+):$")
_CANDIDATE = re.compile(r"^  Candidate: (\S+)$")
# A version row of the table: five columns (" *** " marks the installed one), the version, its
# priority. The rows under it that say where it comes from are indented by eight spaces.
_VERSION_ROW = re.compile(r"^ (?:\*\*\*|   ) (\S+) -?\d+$")


def parse_policy(policy_out: str) -> dict[str, Available]:
    """``apt-cache policy P...``: each package's candidate and versions (newest first, as listed).

    A package apt does not know is simply absent from the output, and so from the result."""
    out: dict[str, Available] = {}
    name: str | None = None
    candidate: str | None = None
    versions: list[str] = []

    def close() -> None:
        if name is not None:
            out[name] = Available(candidate, tuple(versions))

    for line in policy_out.splitlines():
        if m := _SECTION.match(line):
            close()
            name, candidate, versions = m.group(1), None, []
        elif m := _CANDIDATE.match(line):
            candidate = None if m.group(1) == "(none)" else m.group(1)
        elif m := _VERSION_ROW.match(line):
            versions.append(m.group(1))
    close()
    return out


def depends_of(show_out: str, package: str, version: str) -> Relations:
    """The ``Depends:`` of one package version in ``apt-cache show``: a list of alternatives, each
    a list of relations as :meth:`PkgRelation.parse_relations` gives them."""
    for stanza in Deb822.iter_paragraphs(show_out.splitlines()):
        if stanza.get("Package") == package and stanza.get("Version") == version:
            return PkgRelation.parse_relations(stanza.get("Depends", ""))
    raise NoFit(f"{package}: apt-cache show has no stanza for version {version}")


# --- choosing -------------------------------------------------------------------------------

_OPS: dict[str, Callable[[Version, Version], bool]] = {
    "=": lambda a, b: a == b,
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    ">>": lambda a, b: a > b,
    "<<": lambda a, b: a < b,
}


def satisfies(version: str, constraint: Constraint) -> bool:
    if constraint is None:
        return True
    op, ref = constraint
    return _OPS[op](Version(version), Version(ref))


def _describe(constraint: Constraint) -> str:
    return "any version" if constraint is None else f"{constraint[0]} {constraint[1]}"


def _listed(available: Available | None) -> str:
    return ", ".join(available.versions) if available and available.versions else "none"


def choose(package: str, constraint: Constraint, available: Available | None, why: str) -> str:
    """The version of ``package`` to fetch under ``constraint``, among those the archive has.

    A bound is met by the version nearest to it (``>= V`` takes V itself when the archive still
    has it, else the next revision): the one closest to what the headers were built with. An
    unversioned package takes apt's candidate, what ``apt-get install`` would take."""
    fits = [v for v in (available.versions if available else ()) if satisfies(v, constraint)]
    if not fits:
        raise NoFit(
            f"{package}: nothing fits {_describe(constraint)} ({why}); "
            f"the archive has {_listed(available)}"
        )
    op = constraint[0] if constraint else None
    if op in (">=", ">>"):
        return min(fits, key=Version)
    if op is None and available is not None and available.candidate in fits:
        return available.candidate
    return max(fits, key=Version)


def choose_source(kver: str, available: Available | None, series: str = SERIES) -> str:
    """linux-source at the image's version, else the newest revision of the same upstream
    version: only a sample driver is read from it, and a revision changes Debian's patches,
    not the sample."""
    versions = available.versions if available else ()
    if kver in versions:
        return kver
    want = Version(kver)
    same = [
        v
        for v in versions
        if Version(v).upstream_version == want.upstream_version and Version(v).epoch == want.epoch
    ]
    if not same:
        source = source_of(series)
        raise NoFit(
            f"{source}: nothing fits {kver} or another revision of {want.upstream_version} "
            f"(the image's version); the archive has {_listed(available)}"
        )
    return max(same, key=Version)


def plan(
    krel: str, kver: str, depends: Relations, policy: dict[str, Available], series: str = SERIES
) -> Plan:
    """Every package to fetch, at its version: the image and its headers at ``kver``, each of
    the headers' ``Depends`` under its own constraint (the first alternative that fits), and
    linux-source."""
    image, headers = f"linux-image-{krel}", f"linux-headers-{krel}"
    why = f"{headers} Depends"
    picks = [
        Pick(image, choose(image, ("=", kver), policy.get(image), "the image's version")),
        Pick(headers, choose(headers, ("=", kver), policy.get(headers), "the image's version")),
    ]
    for alternatives in depends:
        errors: list[str] = []
        for rel in alternatives:
            name = rel["name"]
            try:
                picks.append(Pick(name, choose(name, rel["version"], policy.get(name), why)))
                break
            except NoFit as e:
                errors.append(str(e))
        else:
            raise NoFit(" | ".join(errors))
    source = source_of(series)
    picks.append(Pick(source, choose_source(kver, policy.get(source), series)))
    return Plan(krel, kver, tuple(picks), series)


def resolve(apt_cache: Callable[[Sequence[str]], str], series: str = SERIES) -> Plan:
    """Ask apt-cache (``apt_cache(args)`` returns its standard output) and choose."""
    krel = kernel_release(apt_cache(["depends", META]), series)
    image, headers = f"linux-image-{krel}", f"linux-headers-{krel}"
    kver = parse_policy(apt_cache(["policy", image])).get(image, Available(None, ())).candidate
    if kver is None:
        raise NoFit(f"{image}: apt-cache policy has no candidate version")
    depends = depends_of(apt_cache(["show", f"{headers}={kver}"]), headers, kver)
    names = [image, headers, *(r["name"] for alt in depends for r in alt), source_of(series)]
    return plan(krel, kver, depends, parse_policy(apt_cache(["policy", *names])), series)


# --- I/O --------------------------------------------------------------------------------------


def run_apt_cache(args: Sequence[str]) -> str:
    # LC_ALL=C: policy's "Candidate:" and "Version table:" are translated in other locales.
    env = {**os.environ, "LC_ALL": "C"}
    r = subprocess.run(["apt-cache", *args], capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        raise NoFit(f"apt-cache {' '.join(args)}: {last}")
    return r.stdout


def main(argv: Sequence[str] = ()) -> int:
    args = list(argv)
    series = SERIES
    if args[:1] == ["--series"] and len(args) == 2:
        series = args[1]
    elif args:
        print("usage: resolve.py [--series S]", file=sys.stderr)
        return 2
    try:
        result = resolve(run_apt_cache, series)
    except NoFit as e:
        print(f"fetch: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(result.shell())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
