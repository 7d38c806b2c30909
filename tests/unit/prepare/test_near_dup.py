"""Near-duplicate removal (cleaning.near_dup): what it drops and keeps, how it is counted, checked and configured."""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.prepare.clean import CleaningStats, clean_documents
from tasks.prepare.config import CleaningConfig, NearDupConfig, PrepareConfig
from tasks.prepare.pipeline import dataset_key, prepare_dataset
from tasks.prepare.sources import RawDocument
from tasks.spec import SpecError, parse_spec
from tests.conftest import REPO, TINY_SPEC, deep_merge
from training.storage import StorageConfig
from validation.data import DataExpectations, SuiteRunner, document_frame, run_document_suite

WORDS = 200
SHINGLE = 5


def _corpus(n: int, seed: int = 7) -> list[str]:
    """`n` documents of WORDS words drawn from 5,000 made-up words: unrelated to one another."""
    rng = random.Random(seed)
    vocabulary = [f"w{i:04d}" for i in range(5000)]
    return [" ".join(rng.choices(vocabulary, k=WORDS)) for _ in range(n)]


def _edited(text: str, changes: int) -> str:
    """`text` with `changes` words replaced, spread out so that each replacement alters SHINGLE shingles."""
    words = text.split()
    step = len(words) // changes
    for k in range(changes):
        words[k * step + step // 2] = f"edit{k}"
    return " ".join(words)


def _jaccard(a: str, b: str) -> float:
    """Exact Jaccard similarity of two texts' SHINGLE-word shingle sets."""

    def shingles(text: str) -> set[tuple[str, ...]]:
        words = text.split()
        return {tuple(words[i : i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}

    x, y = shingles(a), shingles(b)
    return len(x & y) / len(x | y)


def _clean(texts: list[str], **cleaning: object) -> tuple[list[str], CleaningStats]:
    stats = CleaningStats()
    kept = list(clean_documents([RawDocument(t, False, "test") for t in texts], CleaningConfig(**cleaning), stats))
    return kept, stats


BASE = _corpus(30)
CLOSE = _edited(BASE[3], 2)  # Jaccard 0.90 with BASE[3]
MIDDLE = _edited(BASE[7], 8)  # 0.66 with BASE[7]
FAR = _edited(BASE[11], 20)  # 0.32 with BASE[11]
PLANTED = [*BASE, CLOSE, MIDDLE, FAR, BASE[20], CLOSE]  # then an exact copy of a kept and of a dropped document


def test_the_planted_documents_have_the_similarities_the_tests_rely_on() -> None:
    assert _jaccard(BASE[3], CLOSE) == pytest.approx(0.90, abs=0.01)
    assert _jaccard(BASE[7], MIDDLE) == pytest.approx(0.66, abs=0.01)
    assert _jaccard(BASE[11], FAR) == pytest.approx(0.32, abs=0.01)
    assert max(_jaccard(a, b) for i, a in enumerate(BASE) for b in BASE[i + 1 :]) < 0.05


@pytest.mark.parametrize(
    ("threshold", "dropped"), [(0.8, [CLOSE]), (0.55, [CLOSE, MIDDLE]), (0.25, [CLOSE, MIDDLE, FAR])]
)
def test_documents_at_or_above_the_threshold_are_dropped_and_those_below_kept(threshold: float, dropped: list) -> None:
    kept, stats = _clean(PLANTED, near_dup={"threshold": threshold})
    assert kept == [t for t in [*BASE, CLOSE, MIDDLE, FAR] if t not in dropped]
    assert stats.removed["near_duplicate"] == len(dropped) and stats.removed["duplicate"] == 2
    assert stats.read == len(PLANTED) and stats.kept == len(kept)
    flagged = [text for text, row in zip(PLANTED, stats.rows, strict=True) if row[5]]
    assert flagged == dropped and not any(row[4] for row in stats.rows if row[5])  # flagged rows are not kept


def test_an_lsh_candidate_below_the_threshold_is_kept() -> None:
    # at 0.66, about one in four such pairs shares an LSH band with its original at threshold 0.8
    pairs = [text for base in _corpus(20, seed=11) for text in (base, _edited(base, 8))]
    kept, stats = _clean(pairs, near_dup={"threshold": 0.8})
    assert kept == pairs and stats.removed["near_duplicate"] == 0


def test_exact_copies_count_as_duplicates_never_as_near_duplicates() -> None:
    _, stats = _clean([BASE[0], BASE[0], BASE[1], BASE[1], BASE[1]], near_dup={})
    assert stats.removed["duplicate"] == 3 and stats.removed["near_duplicate"] == 0
    assert [(row[2], row[5]) for row in stats.rows] == [(False, False), (True, False), (False, False)] + [
        (True, False)
    ] * 2
    # with exact de-duplication off, an exact copy is a near-duplicate (similarity 1)
    _, stats = _clean([BASE[0], BASE[0]], dedup=False, near_dup={})
    assert stats.removed == {**stats.removed, "duplicate": 0, "near_duplicate": 1}


def test_the_rule_is_off_by_default_and_removes_nothing_then() -> None:
    assert CleaningConfig().near_dup is None
    kept, stats = _clean(PLANTED)
    assert kept == [*BASE, CLOSE, MIDDLE, FAR]
    assert stats.removed["near_duplicate"] == 0 and not any(row[5] for row in stats.rows)


def _near_copies(n: int, seed: int) -> list[str]:
    """Documents edited from one another by chance, many of them near the 0.8 threshold."""
    rng = random.Random(seed)
    base = _corpus(n // 4, seed)
    return [_edited(rng.choice(base), rng.choice([1, 3, 4, 5, 6])) for _ in range(n)] + base


_KEPT_IN_A_CHILD = """
import json, sys
from tasks.prepare.clean import CleaningStats, clean_documents
from tasks.prepare.config import CleaningConfig
from tasks.prepare.sources import RawDocument
texts = json.load(sys.stdin)
stats = CleaningStats()
kept = list(clean_documents([RawDocument(t, False, "t") for t in texts], CleaningConfig(near_dup={}), stats))
print(json.dumps([kept, stats.removed]))
"""


def test_the_same_corpus_loses_the_same_documents_in_every_process() -> None:
    texts = _near_copies(120, seed=3)
    runs = []
    for hash_seed in ("1", "2"):  # Python's own str hashes differ between these processes
        done = subprocess.run(
            [sys.executable, "-c", _KEPT_IN_A_CHILD],
            input=json.dumps(texts), capture_output=True, text=True, check=True, cwd=REPO,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        )  # fmt: skip
        runs.append(json.loads(done.stdout))
    kept, stats = _clean(texts, near_dup={})
    assert runs[0] == runs[1] == [kept, stats.removed]
    assert 0 < stats.removed["near_duplicate"] < len(texts)  # the corpus exercises the rule both ways


def test_the_count_reaches_the_steps_result(tmp_path: Path) -> None:
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in PLANTED))
    cfg = PrepareConfig(
        output_url=str(tmp_path / "datasets"),
        sources=[{"url": str(source)}],
        tokenizer={"kind": "bytes"},
        cleaning={"near_dup": {"threshold": 0.55}},
    )
    result = prepare_dataset(cfg, StorageConfig(), validate=False)
    assert result.cleaning["removed"]["near_duplicate"] == 2 and result.cleaning["removed"]["duplicate"] == 2
    assert result.cleaning["kept"] == len(BASE) + 1


def test_document_suite_fails_when_near_duplicates_exceed_their_share() -> None:
    _, stats = _clean(PLANTED, near_dup={"threshold": 0.55})  # 2 near-duplicates of 35 documents read
    frame = document_frame(stats.rows)
    assert frame["is_near_duplicate"].mean() == pytest.approx(2 / 35)
    with SuiteRunner() as runner:
        _, failed = run_document_suite(runner, frame, DataExpectations(max_near_duplicate_fraction=0.05), 32, None)
        assert [(f.expectation, f.column) for f in failed] == [
            ("expect_column_mean_to_be_between", "is_near_duplicate")
        ]
        assert failed[0].observed == pytest.approx(2 / 35) and failed[0].kwargs["max_value"] == 0.05
        _, failed = run_document_suite(runner, frame, DataExpectations(max_near_duplicate_fraction=0.06), 32, None)
        assert failed == []


PREPARE = {"output_url": "/tmp/d", "builtin_corpus": "python-docs", "tokenizer": {"kind": "bytes"}}
SPEC = deep_merge(TINY_SPEC, {"checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}})


@pytest.mark.parametrize(
    ("near_dup", "problem"),
    [
        ({"threshold": 0}, "data.prepare.cleaning.near_dup.threshold=0: must be > 0"),
        ({"threshold": 1.5}, "data.prepare.cleaning.near_dup.threshold=1.5: must be < 1"),
        ({"threshold": float("nan")}, "data.prepare.cleaning.near_dup.threshold=NaN: must be a finite number"),
        ({"shingle_words": 0}, "data.prepare.cleaning.near_dup.shingle_words=0: must be >= 1"),
        ({"num_perm": 8}, "data.prepare.cleaning.near_dup.num_perm=8: must be >= 16"),
        ({"num_perm": 4096}, "data.prepare.cleaning.near_dup.num_perm=4096: must be <= 1024"),
        ({"shingle_chars": 5}, "data.prepare.cleaning.near_dup.shingle_chars=5: is not a known field"),
        (
            {"threshold": 0.995},
            "data.prepare.cleaning.near_dup.threshold=0.995: MinHash LSH cannot be tuned this close to 1 with "
            "num_perm=128 (it would get fewer than 2 bands); set num_perm to 256 or lower the threshold",
        ),
    ],
)
def test_the_spec_refuses_a_bad_near_dup_setting_naming_the_field(near_dup: dict, problem: str) -> None:
    prepare = {**PREPARE, "cleaning": {"near_dup": near_dup}}
    with pytest.raises(SpecError) as caught:
        parse_spec(deep_merge(SPEC, {"data": {"dataset_url": None, "prepare": prepare}}))
    assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems


def test_an_empty_mapping_turns_the_rule_on_with_its_defaults_and_null_leaves_it_off() -> None:
    def near_dup(value: object) -> NearDupConfig | None:
        prepare = {**PREPARE, "cleaning": {"near_dup": value}}
        spec = parse_spec(deep_merge(SPEC, {"data": {"dataset_url": None, "prepare": prepare}}))
        assert spec.data.prepare is not None
        return spec.data.prepare.cleaning.near_dup

    assert near_dup({}) == NearDupConfig(threshold=0.8, shingle_words=5, num_perm=128)
    assert near_dup(None) is None


def _key(**cleaning: object) -> str:
    cfg = PrepareConfig.model_validate({**PREPARE, "cleaning": cleaning})
    return dataset_key(cfg, [], None)


def test_turning_the_rule_on_or_changing_a_setting_changes_the_dataset_key() -> None:
    keys = {
        _key(),
        _key(near_dup={}),
        _key(near_dup={"threshold": 0.7}),
        _key(near_dup={"shingle_words": 3}),
        _key(near_dup={"num_perm": 256}),
    }
    assert len(keys) == 5


def test_a_new_datasketch_changes_the_key_only_while_the_rule_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _key(), _key(near_dup={})
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "99.0" if name == "datasketch" else real(name))
    assert _key() == before[0] and _key(near_dup={}) != before[1]
