"""The kernel tier's Python tools (``kernel-tier/*.py``) as modules: the directory's name has a
hyphen (it holds shell scripts run by path), so they are loaded by file, not imported."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.support.paths import REPO

KERNEL_TIER = REPO / "kernel-tier"


def load(name: str) -> ModuleType:
    """``kernel-tier/<name>.py``, loaded once per test session."""
    qualified = f"kernel_tier_{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    spec = importlib.util.spec_from_file_location(qualified, KERNEL_TIER / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the class is made
    sys.modules[qualified] = module
    spec.loader.exec_module(module)
    return module
