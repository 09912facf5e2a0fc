"""How much hypothesis explores in each tier of the suite.

``make test`` (and a plain pytest run) keeps hypothesis's own default profile: 100 examples
for a property that names no count, and every count a test names. ``make test-fast`` loads
the ``fast`` profile (``--hypothesis-profile=fast``, registered by tests/conftest.py): fewer
examples and no deadline. A test that names its own count writes the full tier's number
through ``examples``, which scales it as the loaded profile scales hypothesis's default, so
one knob (the profile's ``max_examples``) sets every property's share; a profile with more
examples than the default explores more everywhere. A generated corpus that plays the part of
examples (tests/support/domain_corpus.py's documents) takes its share the same way.
"""

from __future__ import annotations

from hypothesis import settings

#: hypothesis's own default ``max_examples``: the full tier's scale, 1.
DEFAULT_EXAMPLES = 100
FAST = "fast"
#: The fast tier's share of every count: a fifth. Each property still runs its explicit
#: examples and a few dozen generated ones; the full counts run in ``make test`` (CI).
FAST_EXAMPLES = 20


def register_profiles() -> None:
    """The fast tier's profile. No deadline: a shared, loaded machine makes timing flaky."""
    settings.register_profile(FAST, max_examples=FAST_EXAMPLES, deadline=None)


def examples(full: int, *, least: int = 5, profile: settings | None = None) -> int:
    """``full`` (the full tier's count) scaled as ``profile`` (default: the loaded one) scales
    hypothesis's default; never below ``least``, nor ``full`` when that is less."""
    current = settings.default if profile is None else profile
    scaled = round(full * current.max_examples / DEFAULT_EXAMPLES)
    return max(min(least, full), scaled)
