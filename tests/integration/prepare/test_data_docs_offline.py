"""The Data Docs that prepare-data publishes read offline: a headless Chromium with no network at all
(its own empty network namespace) renders the page, and the screenshot and the DOM show every
expectation with its verdict. Great Expectations' own CDN-based index fails the same check."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import DATA_DOCS_DIR, DataValidationError, PrepareResult, prepare_dataset
from tests.processes import run_group
from training.storage import StorageConfig
from validation.data_report import FAIL_RGB, PASS_RGB

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (.ci/apt/test/browser.txt)"),
]

WINDOW = (1200, 2400)
BADGE_PIXELS = 300
"""A badge is about 60 x 24 pixels of which its text covers less than half: at least this many of its colour."""


def _config(tmp_path: Path, **overrides: object) -> PrepareConfig:
    source = tmp_path / "corpus.jsonl"
    texts = [f'document <b>{i}</b> & "quoted" text, long enough to be kept ' * 3 for i in range(200)]
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return PrepareConfig(
        output_url=str(tmp_path / "datasets"),
        sources=[{"url": str(source)}],
        tokenizer={"kind": "bytes"},
        val_fraction=0.2,
        shard_tokens=2048,
        **overrides,
    )


@pytest.fixture(scope="module")
def passed(tmp_path_factory: pytest.TempPathFactory) -> PrepareResult:
    """A dataset whose suites all pass."""
    return prepare_dataset(_config(tmp_path_factory.mktemp("passed")), StorageConfig())


@pytest.fixture(scope="module")
def rejected(tmp_path_factory: pytest.TempPathFactory) -> DataValidationError:
    """A dataset rejected by one expectation of the dataset suite (too few validation documents)."""
    cfg = _config(tmp_path_factory.mktemp("rejected"), expectations={"min_val_documents": 10**6})
    with pytest.raises(DataValidationError) as caught:
        prepare_dataset(cfg, StorageConfig())
    return caught.value


@dataclass
class Rendered:
    """What the browser showed: the table rows of the DOM (cell texts) and the screenshot's pixels."""

    rows: list[list[str]]
    pixels: np.ndarray

    def count(self, rgb: tuple[int, int, int], tolerance: int = 6) -> int:
        """Pixels within `tolerance` of `rgb` in every channel."""
        return int((np.abs(self.pixels - np.array(rgb, dtype=np.int16)) <= tolerance).all(axis=-1).sum())


def _render_offline(page: Path, tmp_path: Path) -> Rendered:
    """One Chromium start in a network namespace with no interface: DOM and screenshot of `page`."""
    shot = tmp_path / "shot.png"
    offline = ["unshare", "--net"] if os.geteuid() == 0 else ["unshare", "--net", "--map-root-user"]
    width, height = WINDOW
    done = run_group(
        [
            *offline,
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=5000",
            f"--window-size={width},{height}",
            f"--screenshot={shot}",
            "--dump-dom",
            page.as_uri(),
        ],
        timeout=120,
    )
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    return Rendered(_table_rows(done.stdout), _png_pixels(shot))


class _Rows(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self.rows:
            self.rows[-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _table_rows(dom: str) -> list[list[str]]:
    parser = _Rows()
    parser.feed(dom)
    return parser.rows


def _png_pixels(path: Path) -> np.ndarray:
    """Height x width x RGB of a screenshot (Pillow comes with matplotlib)."""
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


def _expectation_rows(rendered: Rendered) -> list[list[str]]:
    """Rows that show one expectation: its name first, its verdict last."""
    return [row for row in rendered.rows if row and row[0].startswith("expect_") and row[-1] in ("PASS", "FAIL")]


def _shows_results(rendered: Rendered, evaluated: int) -> list[str]:
    """What the page fails to show: every expectation as a row with a verdict, and the verdict badges in colour."""
    problems = []
    rows = _expectation_rows(rendered)
    if len(rows) != evaluated:
        problems.append(f"{len(rows)} expectation rows with a verdict, {evaluated} evaluated")
    badges = sum(1 for row in rows if row[-1] == "PASS")
    if rendered.count(PASS_RGB) < BADGE_PIXELS * badges or not rows:
        problems.append(f"{rendered.count(PASS_RGB)} pixels of the pass colour for {badges} pass badges")
    return problems


def test_the_printed_data_docs_url_shows_every_expectation_and_its_verdict_offline(
    passed: PrepareResult, tmp_path: Path
) -> None:
    page = Path(passed.data_docs_url)
    assert page.is_file() and page.parent.name == "report"
    rendered = _render_offline(page, tmp_path)
    evaluated = passed.validation["evaluated_expectations"]
    assert evaluated >= 14 and _shows_results(rendered, evaluated) == []
    rows = _expectation_rows(rendered)
    assert all(row[-1] == "PASS" for row in rows) and rendered.count(FAIL_RGB) == 0
    assert ["expect_column_mean_to_be_between", "is_duplicate", "max_value=0.5", "0.0", "PASS"] in rows
    splits = {row[0]: row[1:] for row in rendered.rows if row and row[0] in passed.splits}
    assert splits == {name: [str(c["docs"]), str(c["tokens"])] for name, c in passed.splits.items()}


def test_a_rejected_dataset_shows_the_failed_expectation_in_red_offline(
    rejected: DataValidationError, tmp_path: Path
) -> None:
    assert rejected.docs_url and rejected.docs_url in str(rejected)
    rendered = _render_offline(Path(rejected.docs_url), tmp_path)
    failed = [row for row in _expectation_rows(rendered) if row[-1] == "FAIL"]
    assert [row[:2] for row in failed] == [["expect_column_values_to_be_between", "counted_docs"]]
    assert failed[0][3].startswith("1 unexpected of 1")
    # the FAIL badge of the expectation, of its validation (summary and heading) and of the whole page
    assert rendered.count(FAIL_RGB) >= 4 * BADGE_PIXELS


def test_great_expectations_own_index_fails_the_same_check_offline(passed: PrepareResult, tmp_path: Path) -> None:
    page = Path(passed.dataset_url, DATA_DOCS_DIR, "index.html")
    assert page.is_file()
    rendered = _render_offline(page, tmp_path)
    problems = _shows_results(rendered, passed.validation["evaluated_expectations"])
    assert len(problems) == 2, problems
