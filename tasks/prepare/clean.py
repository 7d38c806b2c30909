"""Cleaning: normalise, trim, drop empty / short / long / invalid-UTF-8 documents, exact duplicates and
(optionally) near-duplicates."""

from __future__ import annotations

import hashlib
import unicodedata
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tasks.prepare.config import CleaningConfig, NearDupConfig
from tasks.prepare.sources import RawDocument

RULES = ("invalid_utf8", "empty", "too_short", "too_long", "duplicate", "near_duplicate")
MINHASH_SEED = 1
"""Seed of the MinHash permutations: fixed, so that the same corpus loses the same near-duplicates every run."""


@dataclass
class CleaningStats:
    """How many documents were read, kept, and removed by each rule (the first rule that applies)."""

    read: int = 0
    kept: int = 0
    invalid_utf8_seen: int = 0
    removed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    rows: list[tuple[int, bool, bool, bool, bool, bool]] = field(default_factory=list, repr=False)
    """Per document read: (n_chars, invalid_utf8, is_duplicate, dropped, kept, is_near_duplicate), for the
    document suite (n_chars is max_chars + 1, a lower bound, for a record skipped unread)."""

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


class NearDuplicates:
    """The documents kept so far in a MinHash LSH index: a new one is a near-duplicate of one of them, or joins."""

    def __init__(self, cfg: NearDupConfig) -> None:
        from datasketch import MinHash  # the import takes a third of a second

        self.cfg = cfg
        # crc32 (C, deterministic) instead of datasketch's default SHA-1 halves the hashing time; datasketch
        # mixes every input hash (MurmurHash3's finaliser) before permuting it.
        self._empty = MinHash(num_perm=cfg.num_perm, seed=MINHASH_SEED, hashfunc=zlib.crc32)
        self._index = cfg.lsh_index()
        self._kept: list[MinHash] = []

    def shingles(self, text: str) -> set[bytes]:
        """Each run of `shingle_words` consecutive words (whitespace-separated), as UTF-8."""
        words, n = text.split(), self.cfg.shingle_words
        return {" ".join(words[i : i + n]).encode() for i in range(max(1, len(words) - n + 1))}

    def seen(self, text: str) -> bool:
        """True if an earlier kept document's estimated Jaccard similarity with `text` reaches the threshold;
        otherwise `text` is indexed as kept."""
        sketch = self._empty.copy()
        sketch.update_batch(self.shingles(text))
        # LSH candidates share a band only: confirm each by its estimated similarity
        if any(sketch.jaccard(self._kept[key]) >= self.cfg.threshold for key in self._index.query(sketch)):
            return True
        self._index.insert(len(self._kept), sketch, check_duplication=False)
        self._kept.append(sketch)
        return False


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
    near = NearDuplicates(cfg.near_dup) if cfg.near_dup is not None else None
    for doc in docs:
        stats.read += 1
        if doc.unread_bytes is not None:  # too large to hold max_chars characters: never read in
            stats.removed["too_long"] += 1
            stats.rows.append((cfg.max_chars + 1, False, False, True, False, False))
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
            if rule is None and near is not None and near.seen(text):
                rule = "near_duplicate"
        dropped = rule is not None and rule not in ("duplicate", "near_duplicate")
        stats.rows.append((len(text), doc.invalid_utf8, duplicate, dropped, rule is None, rule == "near_duplicate"))
        if rule is not None:
            stats.removed[rule] += 1
            continue
        stats.kept += 1
        yield text, digest
