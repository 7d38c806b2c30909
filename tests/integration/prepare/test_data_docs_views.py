"""Data Docs are rendered with GE's page views, their Jinja templates compiled once per process."""

from __future__ import annotations

import re
from pathlib import Path

import jinja2
import pandas as pd
import pytest

from validation.data import SuiteRunner
from validation.data_docs_views import TEMPLATE_CACHE


def _suite(runner: SuiteRunner, column: str) -> list:
    e = runner.gx.expectations
    return [e.ExpectColumnValuesToBeBetween(column=column, min_value=0), e.ExpectColumnValuesToNotBeNull(column=column)]


def _build(tmp_path: Path, name: str) -> Path:
    with SuiteRunner(docs_dir=str(tmp_path / name)) as runner:
        runner.run("lengths", pd.DataFrame({"n_tokens": [1, 5, -2]}), _suite(runner, "n_tokens"))
        return Path(runner.build_docs())


def test_a_second_build_in_the_process_compiles_no_template_and_renders_the_same_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled: list[str | None] = []
    original = jinja2.Environment.compile

    def counting(self, source, name=None, filename=None, raw=False, defer_init=False):  # noqa: ANN001, ANN202
        compiled.append(name)
        return original(self, source, name, filename, raw, defer_init)

    monkeypatch.setattr(jinja2.Environment, "compile", counting)
    TEMPLATE_CACHE.clear()  # earlier tests in this process may have filled it
    first = _build(tmp_path, "first")
    first_compiles = len(compiled)
    compiled.clear()
    second = _build(tmp_path, "second")
    named = [n for n in compiled if n is not None]  # templates from GE's package; from_string ones have no name
    assert first_compiles > 10
    assert named == [], f"templates compiled again: {named}"

    def pages(root: Path) -> list[str]:  # the run's timestamp folder left out
        return sorted(
            re.sub(r"/\d{8}T\d{6}\.\d+Z/", "/RUN/", p.relative_to(root).as_posix()) for p in root.rglob("*.html")
        )

    assert "index.html" in pages(first) and any(p.startswith("validations/lengths") for p in pages(first))
    assert pages(first) == pages(second)
    html = next(second.glob("validations/lengths*/**/*.html")).read_text()
    assert "expect_column_values_to_be_between" in html.replace(" ", "_").lower() or "n_tokens" in html
    assert "Failed" in html or "failed" in html
