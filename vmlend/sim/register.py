"""The lender register: which borrow each lent device serves now, as its lender knows it.

The simulated cluster's hooks, CLI calls and agents run as separate processes, and the
nemesis test (``tests/scenarios/test_nemesis.py``) runs them without simulated hardware (the
sim backend's ledger only). This register stands in for the one thing of the lender's
hardware that promise (a) is about (DESIGN, "Two promises, kept apart": the device serves only
the borrow of its newest fencing token): per device, the newest fencing token it was given and
the borrower it serves, one JSON file per device under a directory every host of the simulated
cluster shares (``$VMLEND_SIM_LENDERS``; unset: no register, and the sim backend is the
ledger alone, as before).

Its rules are the SmartIO driver's ``token`` attribute and ``take_back`` (docs/smartio-contract.md
§4; ``vmlend.kernel.backend.SmartioFabric.create_mdev`` and ``take_back``):

- ``serve``: an mdev creation for a hold writes the hold's (token, borrower) first, and is
  refused (``StaleTokenError``, nothing changed) when the device already serves a newer token
  or was taken back for this one;
- ``end``: a normal release, or the removal of the holder's mdev, clears the borrower and
  keeps the token (a borrower other than the one named, or a newer token, is left alone); a
  release also spends the hold's token (``spend``), served or not, so an mdev creation that
  read the hold before the release and serves it after is refused;
- ``take_back``: the lender's take-back clears the borrower with the fence's token and retires
  it (a later ``serve`` of that token is refused: its hold has ended), and is refused
  (``StaleTokenError``, nothing changed) for a token older than the device's.

Each change is a read-modify-write under a lock file of the device's (``flock``), written
whole (a temporary file renamed over the old one), so a reader without the lock (the nemesis's
sampler) sees one state or the next, never half of one. Every write, and every refusal, is
also one line of ``history.log`` beside the files (time, process, what, before, after), for
whoever reads a failed run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from vmlend.errors import StaleTokenError, StateError
from vmlend.events import EventLog

#: The directory of the simulated cluster's lender register; unset: none.
LENDERS_ENV = "VMLEND_SIM_LENDERS"


class Serving(msgspec.Struct, frozen=True):
    """What device ``fdid`` serves: the newest fencing token it was given (0: none yet) and
    the borrow of that token it serves ("node/vm"; "": none, the device is idle or reset)."""

    fdid: int
    token: int = 0
    borrower: str = ""
    #: the token the device was last taken back for: no mdev is made for it again
    retired: int = 0


def borrower_of(node: str, vm: str) -> str:
    """How the register names a borrowing VM."""
    return f"{node}/{vm}"


class LenderRegister:
    """The register under ``directory`` (created when missing)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        #: The protocol's event log (``vmlend.events``; None: none): each write, each
        #: refusal, under the device's lock (so in the device's order).
        self.events = EventLog.from_env()

    @classmethod
    def from_env(cls) -> LenderRegister | None:
        """The register ``$VMLEND_SIM_LENDERS`` names; None when it names none."""
        where = os.environ.get(LENDERS_ENV)
        return cls(Path(where)) if where else None

    def _path(self, fdid: int) -> Path:
        return self.directory / f"{fdid:#x}.json"

    # --- reading (no lock: every file is replaced whole) --------------------------------------
    def read(self, fdid: int) -> Serving:
        try:
            raw = self._path(fdid).read_bytes()
        except FileNotFoundError:
            return Serving(fdid)
        try:
            return msgspec.json.decode(raw, type=Serving)
        except msgspec.DecodeError as e:
            raise StateError(f"lender register {self._path(fdid)}: {e}") from None

    def all(self) -> dict[int, Serving]:
        """Every device the register has a record of."""
        out = {}
        for path in sorted(self.directory.glob("0x*.json")):
            try:
                fdid = int(path.stem, 16)
            except ValueError:
                continue
            out[fdid] = self.read(fdid)
        return out

    # --- the three writes -----------------------------------------------------------------------
    def serve(self, fdid: int, token: int, borrower: str) -> Serving:
        """An mdev creation for the hold with fencing token ``token`` of ``borrower``: the
        device serves it from now on. ``StaleTokenError`` (nothing changed) when the device
        already serves a newer token."""
        with self._locked(fdid):
            now = self.read(fdid)
            if token < now.token or token <= now.retired:
                self._note("serve", now, None, f"{token} {borrower}")
                raise StaleTokenError(fdid, token, now.token, "an mdev creation")
            after = Serving(fdid, token, borrower, now.retired)
            if after != now:
                self._write(after)
            self._note("serve", now, after, f"{token} {borrower}")
            return after

    def end(
        self, fdid: int, borrower: str, token: int | None = None, *, spend: bool = False
    ) -> bool:
        """``borrower``'s borrow ends (a normal release, or its mdev removed): the device
        serves nobody, its token stays. Only if it serves ``borrower`` (under ``token``, when
        given): whether it did. ``spend`` (a hold's release; needs ``token``): the token is
        spent whether or not the device serves it yet, so an mdev creation for that hold still
        in flight elsewhere is refused when it comes."""
        with self._locked(fdid):
            now = self.read(fdid)
            asked = f"{token} {borrower}" + (" spend" if spend else "")
            retired = max(now.retired, token) if spend and token is not None else now.retired
            serves = now.borrower == borrower and (token is None or token == now.token)
            after = Serving(fdid, now.token, "" if serves else now.borrower, retired)
            if after != now:
                self._write(after)
            self._note("end", now, after, asked)
            return serves

    def take_back(self, fdid: int, token: int) -> Serving:
        """The lender takes the device back for the fence with token ``token``: it serves
        nobody, and ``token`` is its newest. ``StaleTokenError`` (nothing changed) when the
        device has served a newer token (a newer holder has it: not this take-back's)."""
        with self._locked(fdid):
            now = self.read(fdid)
            if token < now.token:
                self._note("take-back", now, None, str(token))
                raise StaleTokenError(fdid, token, now.token, "a take-back")
            after = Serving(fdid, token, "", max(token, now.retired))
            if after != now:
                self._write(after)
            self._note("take-back", now, after, str(token))
            return after

    # --- helpers ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, fdid: int) -> Iterator[None]:
        with (self.directory / f"{fdid:#x}.lock").open("a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _note(self, op: str, before: Serving, after: Serving | None, asked: str) -> None:
        """One line of the history (under the device's lock): ``after`` None is a refusal."""
        t = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}"
        done = "REFUSED" if after is None else f"{after.token} {after.borrower or '-'}"
        if after == before:
            done += " (unchanged)"
        line = (
            f"{stamp}Z pid={os.getpid()} {before.fdid:#x} {op}({asked.strip()}):"
            f" {before.token} {before.borrower or '-'} -> {done}\n"
        )
        with (self.directory / "history.log").open("a") as f:
            f.write(line)
        if self.events is not None:
            self.events.note(
                op,
                fdid=before.fdid,
                asked=asked.strip(),
                refused=after is None,
                token=(after or before).token,
                borrower=(after or before).borrower,
                retired=(after or before).retired,
            )

    def _write(self, serving: Serving) -> None:
        path = self._path(serving.fdid)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode(serving))
        os.replace(tmp, path)
