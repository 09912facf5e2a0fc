"""Where the repository's parts are, for tests at any depth of the tree."""

from __future__ import annotations

from pathlib import Path

#: The test tree's root (``tests/``).
TESTS = Path(__file__).resolve().parent.parent
#: The repository's root.
REPO = TESTS.parent
#: Test data files (``tests/data``).
DATA = TESTS / "data"
