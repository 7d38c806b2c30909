"""Cleaning: normalise, trim, drop empty / short / long / invalid-UTF-8 documents and exact duplicates."""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tasks.prepare.config import CleaningConfig
from tasks.prepare.sources import RawDocument

RULES = ("invalid_utf8", "empty", "too_short", "too_long", "duplicate")


@dataclass
class CleaningStats:
    """How many documents were read, kept, and removed by each rule (the first rule that applies)."""

    read: int = 0
    kept: int = 0
    invalid_utf8_seen: int = 0
    removed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    rows: list[tuple[int, bool, bool, bool, bool]] = field(default_factory=list, repr=False)
    """Per document read: (n_chars, invalid_utf8, is_duplicate, dropped, kept), for the document suite
    (n_chars is max_chars + 1, a lower bound, for a record skipped unread)."""

    def to_json(self) -> dict[str, object]:
        """Counts for reports."""
        return {
            "read": self.read,
            "kept": self.kept,
            "invalid_utf8_seen": self.invalid_utf8_seen,
            "removed": self.removed,
        }


def clean_text(text: str, cfg: CleaningConfig) -> str:
    """Normalise Unicode and line endings, trim surrounding whitespace."""
    if cfg.unicode_normalization:
        text = unicodedata.normalize(cfg.unicode_normalization, text)
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


def clean_documents(docs: Iterable[RawDocument], cfg: CleaningConfig, stats: CleaningStats) -> Iterator[str]:
    """The documents that survive every rule; `stats` is filled as they stream past."""
    for text, _ in cleaned_with_digests(docs, cfg, stats):
        yield text


def cleaned_with_digests(
    docs: Iterable[RawDocument], cfg: CleaningConfig, stats: CleaningStats
) -> Iterator[tuple[str, bytes]]:
    """Each document that survives every rule with the sha256 of its UTF-8 text (the key of de-duplication
    and of the split, hashed once for both); `stats` is filled as they stream past."""
    seen: set[bytes] = set()
    for doc in docs:
        stats.read += 1
        if doc.unread_bytes is not None:  # too large to hold max_chars characters: never read in
            stats.removed["too_long"] += 1
            stats.rows.append((cfg.max_chars + 1, False, False, True, False))
            continue
        stats.invalid_utf8_seen += doc.invalid_utf8
        text = clean_text(doc.text, cfg)
        rule = None
        duplicate = False
        digest = b""
        if doc.invalid_utf8 and cfg.invalid_utf8 == "drop":
            rule = "invalid_utf8"
        elif not text:
            rule = "empty"
        elif len(text) < cfg.min_chars:
            rule = "too_short"
        elif len(text) > cfg.max_chars:
            rule = "too_long"
        else:
            digest = hashlib.sha256(text.encode("utf-8")).digest()
            if cfg.dedup:
                duplicate = digest in seen
                seen.add(digest)
                rule = "duplicate" if duplicate else None
        dropped = rule is not None and rule != "duplicate"
        stats.rows.append((len(text), doc.invalid_utf8, duplicate, dropped, rule is None))
        if rule is not None:
            stats.removed[rule] += 1
            continue
        stats.kept += 1
        yield text, digest
