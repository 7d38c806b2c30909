"""Showing text that came from outside (shared storage, a spec, a node) in logs and messages.

A host name in a forged lease record or a split name in a planted dataset may hold a newline or a terminal escape
that, printed as it is, would start a fake log line or rewrite the terminal. Such text goes through
`escape_untrusted` wherever it reaches a log or an error message.
"""

from __future__ import annotations

DEFAULT_LIMIT = 256
"""Characters of untrusted text shown before it is cut (a host name, a file name or a job id needs far fewer)."""


def escape_untrusted(text: str, limit: int | None = DEFAULT_LIMIT) -> str:
    """`text` with every non-printable character (control, format, line separator) written as repr writes it
    (`\\n`, `\\x1b`, `\\u202e`), cut to `limit` characters first (None: no cut) with the full length said."""
    cut = limit is not None and len(text) > limit
    head = text[:limit] if cut else text
    if not head.isprintable():
        head = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in head)
    return f"{head}... ({len(text)} characters)" if cut else head
