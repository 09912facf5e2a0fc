"""A namespace's blocks in a sparse backing file: only blocks written take disk space."""

from __future__ import annotations

import os
from pathlib import Path


class Namespace:
    """``blocks`` logical blocks of ``block_size`` bytes kept in ``path`` (created sparse)."""

    def __init__(self, nsid: int, path: Path, blocks: int, block_size: int = 512) -> None:
        if nsid < 1:
            raise ValueError(f"namespace ids start at 1, got {nsid}")
        if blocks < 1 or block_size not in (512, 4096):
            raise ValueError(f"bad namespace geometry: {blocks} blocks of {block_size} bytes")
        self.nsid = nsid
        self.path = Path(path)
        self.blocks = blocks
        self.block_size = block_size
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.ftruncate(self._fd, blocks * block_size)

    @property
    def size(self) -> int:
        return self.blocks * self.block_size

    @property
    def lba_shift(self) -> int:
        return self.block_size.bit_length() - 1

    def _check(self, lba: int, count: int) -> None:
        if lba < 0 or count < 1 or lba + count > self.blocks:
            raise ValueError(f"blocks {lba}+{count} outside namespace {self.nsid}")

    def read(self, lba: int, count: int) -> bytes:
        self._check(lba, count)
        want = count * self.block_size
        data = os.pread(self._fd, want, lba * self.block_size)
        return data + bytes(want - len(data))

    def write(self, lba: int, data: bytes) -> None:
        if len(data) % self.block_size:
            raise ValueError(f"writes are whole blocks of {self.block_size} bytes")
        self._check(lba, len(data) // self.block_size)
        os.pwrite(self._fd, data, lba * self.block_size)

    def flush(self) -> None:
        os.fsync(self._fd)

    def allocated_bytes(self) -> int:
        """Disk space the backing file really uses (it is sparse)."""
        return os.fstat(self._fd).st_blocks * 512

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
