"""Keep the user's own spelling of every line a rewrite did not change.

lxml re-serialises a whole document in its style (double-quoted attributes, ``<a/>``), so a
one-device edit of ``virsh dumpxml`` output (single quotes) would touch every line. Here the
serialised lines are matched against the original ones, ignoring quote style; matching lines are
taken verbatim from the original. The result is accepted only if it parses to exactly the same
tree (comments included) as lxml's own output, otherwise lxml's output is used as is.
"""

from __future__ import annotations

import re

from lxml import etree

_QUOTE = bytes.maketrans(b"'", b'"')
# An attribute lxml wrote in double quotes whose value needs no escaping in single quotes.
_DOUBLE_QUOTED_ATTR = re.compile(rb'(\s[\w:.-]+)="([^"\'<&]*)"')
_EMPTY_PAIR = re.compile(rb"<([^\s>/]+)([^>]*)></\1>")


def _norm(line: bytes) -> bytes:
    """What lxml would write for this line: double quotes, ``<a></a>`` as ``<a/>``."""
    return _EMPTY_PAIR.sub(rb"<\1\2/>", line.translate(_QUOTE))


def _c14n(data: bytes) -> bytes | None:
    parser = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False)
    try:
        root = etree.fromstring(data, parser)
    except etree.XMLSyntaxError:
        return None
    return etree.tostring(root, method="c14n2", with_comments=True)


def _prefers_single_quotes(original: bytes) -> bool:
    return original.count(b"='") > original.count(b'="')


def _single_quoted(line: bytes) -> bytes:
    return _DOUBLE_QUOTED_ATTR.sub(rb"\1='\2'", line)


def keep_original_lines(original: bytes, serialised: bytes) -> bytes:
    """``serialised`` with every line that is unchanged from ``original`` (up to quote style)
    replaced by the original line; new lines follow the original's attribute quoting."""
    if not original or original == serialised:
        return serialised
    import difflib  # only rewrites get here, never a plain read (the hook's)

    old = original.split(b"\n")
    new = serialised.split(b"\n")
    matcher = difflib.SequenceMatcher(
        a=[_norm(x) for x in old], b=[_norm(x) for x in new], autojunk=False
    )
    restyle = _single_quoted if _prefers_single_quotes(original) else (lambda line: line)
    out: list[bytes] = []
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        out.extend(old[a0:a1] if tag == "equal" else (restyle(x) for x in new[b0:b1]))
    merged = b"\n".join(out)
    if merged != serialised and _c14n(merged) != _c14n(serialised):
        return serialised
    return merged
