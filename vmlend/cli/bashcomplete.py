"""Bash completion that reads the command line as the user typed it.

Bash splits the words it hands a completion function at every character of
``COMP_WORDBREAKS``, ':' among them, so after ``vmlend -c qemu:///system attach`` click's own
bash support saw ``-c qemu`` and a stray ':' and offered subcommands instead of VM names. The
shell function here also passes ``COMP_LINE``, ``COMP_POINT`` and ``COMP_WORDBREAKS`` (a shell
variable, never exported), and the words are split
again from the line up to the cursor, the way a shell would parse them. Every completion
item is one line of the function's input, so a value with a control character (a VM named
with a newline) could forge items: such values are left out, for every shell.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

from click.shell_completion import BashComplete, CompletionItem, add_completion_class


def printable(value: str) -> bool:
    """Whether ``value`` can be offered as one completion item."""
    return not any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value)


class LineBashComplete(BashComplete):
    """click's bash completion, reading ``COMP_LINE`` up to ``COMP_POINT``."""

    source_template = BashComplete.source_template.replace(
        'env COMP_WORDS="${COMP_WORDS[*]}" COMP_CWORD=$COMP_CWORD',
        'env COMP_WORDS="${COMP_WORDS[*]}" COMP_CWORD=$COMP_CWORD'
        ' COMP_LINE="$COMP_LINE" COMP_POINT=$COMP_POINT COMP_WORDBREAKS="$COMP_WORDBREAKS"',
    )

    def get_completion_args(self) -> tuple[list[str], str]:
        line, point = os.environ.get("COMP_LINE"), os.environ.get("COMP_POINT")
        if line is None or point is None or not point.isdigit():
            return super().get_completion_args()
        typed = line[: int(point)]
        try:
            words = shlex.split(typed)
        except ValueError:  # an open quote: the word being typed; bash's own split will do
            return super().get_completion_args()
        incomplete = "" if not typed or typed[-1].isspace() or not words else words.pop()
        return words[1:], incomplete

    def get_completions(self, args: list[str], incomplete: str) -> list[CompletionItem[Any]]:
        items = [i for i in super().get_completions(args, incomplete) if printable(str(i.value))]
        # bash replaces only what follows the word's last break character: offer that part
        cut = incomplete.rfind(":") + 1
        if cut and ":" in os.environ.get("COMP_WORDBREAKS", ":"):
            items = [
                CompletionItem(str(i.value)[cut:], type=i.type, help=i.help)
                if str(i.value).startswith(incomplete[:cut])
                else i
                for i in items
            ]
        return items


def install() -> None:
    """Use it for ``_VMLEND_COMPLETE=bash_source`` and ``bash_complete``."""
    add_completion_class(LineBashComplete, "bash")
