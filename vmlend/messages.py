"""Small helpers that keep user-facing lines right: plurals and non-repeated subjects."""

from __future__ import annotations


def plural(count: int, word: str, words: str | None = None) -> str:
    """``1 device``, ``2 devices`` (``words``: an irregular plural)."""
    return f"{count} {word if count == 1 else (words or word + 's')}"


def about(subject: str, detail: str) -> str:
    """``subject: detail``, unless the detail already starts with the subject (no
    ``device 0x10: device 0x10 is held ...``)."""
    return detail if detail.startswith(subject) else f"{subject}: {detail}"


def single_line(text: str) -> str:
    """``text`` with every control character escaped (``\\n``, ``\\x1b``): an error naming a
    user's value that holds a newline must still be one line, and not forge a second one."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )
