"""A corpus every Python install carries: the standard library's documentation and docstrings.

Documents come in a fixed order: the reference topics of `pydoc_data` (the
language and library documentation that `help()` shows), then the module,
class and function docstrings of the standard library's source files, sorted
by path.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


def stdlib_files() -> list[Path]:
    """The standard library's .py files (no site-packages), sorted for a deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def stdlib_documents(max_bytes: int | None = None, min_chars: int = 1) -> Iterator[str]:
    """Documentation topics, then docstrings, of the standard library, up to `max_bytes` of UTF-8."""
    total = 0
    for doc in _topics_then_docstrings():
        if len(doc) < min_chars:
            continue
        total += len(doc.encode("utf-8"))
        yield doc
        if max_bytes is not None and total >= max_bytes:
            return


def _topics_then_docstrings() -> Iterator[str]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key].strip()
    for path in stdlib_files():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escape sequences in old test files
                tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, UnicodeDecodeError):
            log.debug("skipping unparsable %s", path)
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def split_of(text: str, val_fraction: float) -> str:
    """'val' or 'train' from the document's hash: stable when documents are added or removed."""
    return split_of_digest(hashlib.sha256(text.encode("utf-8")).digest(), val_fraction)


def split_of_digest(digest: bytes, val_fraction: float) -> str:
    """`split_of` for a document whose sha256 is already known."""
    bucket = int.from_bytes(digest[:8], "big") / 2**64
    return "val" if bucket < val_fraction else "train"
