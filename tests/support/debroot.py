"""A clean Debian bookworm root made by ``debootstrap`` from the archive, to install vmlend's
package into (tests/scenarios/test_debian_package.py).

The debootstrap download is cached as a tarball (``--make-tarball`` once, ``--unpack-tarball``
every run), and so are the packages apt fetches inside the root (a directory under the cache,
bind-mounted as the root's ``/var/cache/apt/archives``, seeded with hard links to the host's
own apt cache where it already holds the same files). The root's ``/proc``, ``/sys`` and
``/dev`` are bound for its commands and unmounted at ``close``; ``policy-rc.d`` refuses every
service start, so installing libvirt starts nothing. The root is removed with
``--one-file-system`` and only once nothing is mounted under it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
#: Beside the minimal base: systemd for systemd-analyze, man-db for its man-page check.
INCLUDE = "systemd,man-db"
#: The environment of every command in the root: nothing of the host's (no VMLEND_*).
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
}
HOST_ARCHIVES = Path("/var/cache/apt/archives")
#: A bound on a hung command, not a timing assertion.
TIMEOUT = 900


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=TIMEOUT, check=False, **kw
    )


def mirror() -> str:
    """The Debian mirror apt already uses on this host (deb.debian.org else)."""
    for path in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            if words[:1] == ["deb"] and "bookworm" in words:
                url = next((w for w in words[1:] if "://" in w), None)
                if url and url.rstrip("/").endswith("/debian"):
                    return url
            if words[:1] == ["URIs:"] and words[1].rstrip("/").endswith("/debian"):
                return words[1]
    return MIRROR


def tarball(cache: Path) -> Path:
    """The cached debootstrap tarball, made (downloaded) when missing."""
    tgz = cache / f"{SUITE}-minbase.tgz"
    if tgz.is_file():
        return tgz
    cache.mkdir(parents=True, exist_ok=True)
    work = cache / "make-tarball"
    shutil.rmtree(work, ignore_errors=True)
    part = tgz.with_suffix(".part.tgz")
    run = _run(
        [
            "debootstrap", "--variant=minbase", f"--include={INCLUDE}",
            f"--make-tarball={part}", SUITE, str(work), mirror(),
        ]
    )
    shutil.rmtree(work, ignore_errors=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    part.rename(tgz)  # only a whole tarball is ever found
    return tgz


def mounts_under(path: Path) -> list[str]:
    """Mount points at or under ``path`` (from /proc/self/mountinfo)."""
    top = str(path.resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == top or point.startswith(top + "/"):
            found.append(point)
    return found


class DebRoot:
    """A bookworm root at ``path`` (made afresh), its mounts, and commands run in it."""

    def __init__(self, path: Path, cache: Path, prepare: str) -> None:
        """The root at ``path``, with ``prepare`` (an apt-get command: the package's
        dependencies) run in it. A root so prepared is kept as a tar under ``cache`` (keyed by
        the debootstrap tarball and ``prepare``) and unpacked the next time instead: debootstrap
        and the dependencies' install run once per change of either."""
        self.path = path
        self.archives = cache / "archives"
        self.mounted: list[Path] = []
        #: The caller's, for its report: when it began making the root.
        self.started = time.monotonic()
        self.remove()
        path.parent.mkdir(parents=True, exist_ok=True)
        begun = time.monotonic()
        tgz = tarball(cache)
        self.tarball_in = time.monotonic() - begun  # ~0 when cached
        key = hashlib.sha256(f"{tgz.name} {tgz.stat().st_size} {prepare}".encode()).hexdigest()
        prepared = cache / f"root-{key[:16]}.tar"
        self.seeded = 0
        if prepared.is_file():
            path.mkdir()
            run = _run(["tar", "-xpf", str(prepared), "--numeric-owner", "-C", str(path)])
            assert run.returncode == 0, run.stderr[-3000:]
            self._mount_all()
        else:
            self._bootstrap(tgz)
            self._mount_all()
            run = self.run("apt-get update -qq")
            assert run.returncode == 0, run.stdout + run.stderr
            self.seeded = self.seed_archives(prepare)
            run = self.run(prepare)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            self._save(prepared)
        self.made_in = time.monotonic() - begun

    def _bootstrap(self, tgz: Path) -> None:
        path = self.path
        run = _run(
            [
                "debootstrap", "--variant=minbase", f"--include={INCLUDE}",
                f"--unpack-tarball={tgz}", SUITE, str(path), mirror(),
            ]
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        for deb in (path / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()  # debootstrap's own: the tarball keeps them
        sbin = path / "usr/sbin/policy-rc.d"
        sbin.write_text("#!/bin/sh\n# nothing starts in a test's root\nexit 101\n")
        sbin.chmod(0o755)
        # the walkthrough's 'apt install' as an operator answers it; no recommends: the
        # package's Depends are what it needs
        (path / "etc/apt/apt.conf.d/90vmlend-test").write_text(
            'APT::Get::Assume-Yes "true";\nAPT::Install-Recommends "false";\n'
            # downloads stay root's: the cache is under the checkout, whose every file the
            # hook's ownership check walks (an _apt-owned partial/ would fail it)
            'APT::Sandbox::User "root";\n'
        )
        shutil.copy("/etc/resolv.conf", path / "etc/resolv.conf")

    def _mount_all(self) -> None:
        self._mount(["-t", "proc", "proc"], "proc")
        self._mount(["-t", "sysfs", "sysfs"], "sys")
        self._mount(["--bind", "/dev"], "dev")
        (self.archives / "partial").mkdir(parents=True, exist_ok=True)
        self._mount(["--bind", str(self.archives)], "var/cache/apt/archives")

    def _save(self, prepared: Path) -> None:
        """The prepared root as a tar (not what is mounted; the archives are the cache's)."""
        part = prepared.with_suffix(".part")
        excludes = [f"--exclude=./{m.relative_to(self.path)}/*" for m in self.mounted]
        run = _run(
            ["tar", "-cpf", str(part), "--numeric-owner", "--one-file-system", *excludes,
             "-C", str(self.path), "."]
        )
        assert run.returncode == 0, run.stderr[-3000:]
        for old in prepared.parent.glob("root-*.tar"):
            old.unlink()  # one prepared root: the Depends it was made for changed
        part.rename(prepared)

    def _mount(self, args: list[str], where: str) -> None:
        target = self.path / where
        target.mkdir(parents=True, exist_ok=True)
        run = _run(["mount", *args, str(target)])
        assert run.returncode == 0, run.stderr
        self.mounted.append(target)

    def run(self, command: str, cwd: str = "/") -> subprocess.CompletedProcess[str]:
        """``command`` by the root's /bin/sh, in the root."""
        script = f"cd {cwd} && {command}"
        return _run(["chroot", str(self.path), "/bin/sh", "-c", script], env=ENV)

    def seed_archives(self, command: str) -> int:
        """Hard-link (or copy) into the archive cache the host's cached copies of the packages
        ``command`` (an apt-get install) would download; how many it found."""
        run = self.run(f"{command} --print-uris")
        assert run.returncode == 0, run.stdout + run.stderr
        found = 0
        for line in run.stdout.splitlines():
            words = line.split()
            if len(words) < 2 or not line.startswith("'"):
                continue
            have, want = HOST_ARCHIVES / words[1], self.archives / words[1]
            if not have.is_file() or want.exists():
                continue
            try:
                os.link(have, want)
            except OSError:
                shutil.copy(have, want)
            found += 1
        return found

    def files(self, skip: tuple[str, ...]) -> set[str]:
        """Every path in the root (as seen inside it), not under ``skip`` or a mount."""
        top = str(self.path)
        found = set()
        for dirpath, dirnames, filenames in os.walk(top):
            inside = "/" + os.path.relpath(dirpath, top).removeprefix(".").lstrip("/")
            dirnames[:] = [
                d
                for d in dirnames
                if not os.path.ismount(os.path.join(dirpath, d))
                and not (inside.rstrip("/") + "/" + d).startswith(skip)
            ]
            for name in dirnames + filenames:
                found.add(inside.rstrip("/") + "/" + name)
        return found

    def close(self) -> None:
        """Unmount what was mounted (last first); then the root can go."""
        for target in reversed(self.mounted):
            run = _run(["umount", str(target)])
            assert run.returncode == 0, run.stderr
        self.mounted.clear()
        left = mounts_under(self.path)
        assert not left, f"still mounted under the root: {left}"

    def remove(self) -> None:
        if not self.path.exists():
            return
        left = mounts_under(self.path)
        assert not left, f"refusing to remove {self.path}: mounted under it: {left}"
        run = _run(["rm", "-rf", "--one-file-system", str(self.path)])
        assert run.returncode == 0, run.stderr
