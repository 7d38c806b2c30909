"""The offline report of the data suites: an index and one self-contained HTML page per validation.

Great Expectations' own Data Docs load their CSS and JavaScript from CDNs and show no results
without the internet. These pages carry their CSS inline, have no JavaScript and reference no
external URL (a Content-Security-Policy forbids loading anything), so they read the same offline.
Every value that reaches the HTML (observed values hold corpus text; URLs hold file names) is escaped.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from validation.data import DataProblem, ExpectationOutcome, SuiteRun

INDEX = "index.html"
PASS_RGB = (0x1A, 0x7F, 0x37)
"""Background of a pass badge (tests look for it in screenshots)."""
FAIL_RGB = (0xCF, 0x22, 0x2E)
"""Background of a fail badge."""
MAX_VALUE_CHARS = 300
"""Longer values (observed corpus text) are cut to this many characters."""

_CSS = f"""
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #1f2328; background: #fff; }}
h1 {{ font-size: 22px; margin: 0 0 4px; }} h2 {{ font-size: 18px; margin: 28px 0 8px; }}
.meta {{ color: #59636e; margin: 2px 0; }}
table {{ border-collapse: collapse; margin: 8px 0; }}
th, td {{ border: 1px solid #d1d9e0; padding: 4px 8px; text-align: left; vertical-align: top; }}
th {{ background: #f6f8fa; }}
td.value {{ font-family: ui-monospace, monospace; font-size: 13px; max-width: 420px; overflow-wrap: anywhere; }}
.badge {{ display: inline-block; min-width: 4em; padding: 3px 10px; border-radius: 4px; color: #fff;
  font-weight: 700; text-align: center; }}
.pass {{ background: rgb{PASS_RGB}; }} .fail {{ background: rgb{FAIL_RGB}; }}
"""
_CSP = "default-src 'none'; style-src 'unsafe-inline'"


@dataclass
class ReportContext:
    """What the pages say about the dataset beside the validations."""

    dataset_url: str
    splits: dict[str, dict[str, int]]
    """Per split: `docs` and `tokens` (from the manifest)."""
    generated_at: str
    ge_docs_href: str | None = None
    """Relative link to Great Expectations' own Data Docs, when they were published beside these pages."""
    problems: list[DataProblem] = field(default_factory=list)
    """Each defect found (file, what and the value, fix): the index lists them above the validations."""


def page_name(number: int, run: SuiteRun) -> str:
    """File name of validation `number`'s page (safe characters only)."""
    return f"{number:02d}-{re.sub(r'[^A-Za-z0-9_-]+', '_', run.suite)}.html"


def render_pages(runs: Sequence[SuiteRun], context: ReportContext) -> dict[str, str]:
    """File name -> HTML of the index and of every validation's page."""
    pages = {INDEX: _index(runs, context)}
    for number, run in enumerate(runs, start=1):
        pages[page_name(number, run)] = _run_page(number, run, context)
    return pages


def _e(value: Any) -> str:
    """Escaped text of any value; long values are cut."""
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    if len(text) > MAX_VALUE_CHARS:
        text = text[:MAX_VALUE_CHARS] + "…"
    return html.escape(text, quote=True)


def _badge(success: bool) -> str:
    return '<span class="badge pass">PASS</span>' if success else '<span class="badge fail">FAIL</span>'


def _document(title: str, body: str) -> str:
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )


def _header(runs: Sequence[SuiteRun], context: ReportContext) -> str:
    success = all(run.success for run in runs)
    evaluated = sum(len(run.outcomes) for run in runs)
    failed = sum(len(run.failed) for run in runs)
    return (
        f"<h1>Data validation {_badge(success)}</h1>\n"
        f'<p class="meta">dataset: {_e(context.dataset_url)}</p>\n'
        f'<p class="meta">{len(runs)} validation{"" if len(runs) == 1 else "s"}, {evaluated} expectations,'
        f" {failed} failed; written {_e(context.generated_at)}</p>\n"
    )


_SPLIT_HEADINGS = {"docs": "documents"}


def _splits_table(context: ReportContext) -> str:
    """One row per split, one column per count the splits have (documents and tokens; images for image data)."""
    columns = list(dict.fromkeys(key for s in context.splits.values() for key in s)) or ["docs", "tokens"]
    head = "".join(f"<th>{_e(_SPLIT_HEADINGS.get(c, c))}</th>" for c in columns)
    rows = "".join(
        f"<tr><td>{_e(name)}</td>" + "".join(f"<td>{_e(s.get(c))}</td>" for c in columns) + "</tr>"
        for name, s in context.splits.items()
    )
    return f"<h2>Dataset splits</h2>\n<table><tr><th>split</th>{head}</tr>{rows}</table>\n"


def _rows(run: SuiteRun) -> str:
    return ", ".join(f"{name} {count}" for name, count in run.rows_per_split.items())


def _summary_table(runs: Sequence[SuiteRun]) -> str:
    rows = "".join(
        f'<tr><td><a href="{_e(page_name(number, run))}">{_e(run.suite)}</a></td>'
        f"<td>{_e(_rows(run))}</td><td>{_e(run.run_time)}</td><td>{len(run.outcomes)}</td>"
        f"<td>{len(run.failed)}</td><td>{_badge(run.success)}</td></tr>"
        for number, run in enumerate(runs, start=1)
    )
    return (
        "<h2>Validations</h2>\n<table><tr><th>suite</th><th>rows per split</th><th>time (UTC)</th>"
        f"<th>expectations</th><th>failed</th><th>result</th></tr>{rows}</table>\n"
    )


def _condition(condition: Any) -> str:
    """`column op value` for a simple GE comparison condition; anything else as JSON."""
    if isinstance(condition, dict) and condition.get("type") == "comparison":
        column = (condition.get("column") or {}).get("name")
        return f"{column} {condition.get('operator')} {json.dumps(condition.get('parameter'), default=str)}"
    return condition if isinstance(condition, str) else json.dumps(condition, default=str)


def _arguments(outcome: ExpectationOutcome) -> str:
    parts = []
    for key, value in outcome.kwargs.items():
        if key == "column":
            continue
        if key == "row_condition":
            parts.append(f"where {_condition(value)}")
        else:
            parts.append(f"{key}={json.dumps(value, default=str, ensure_ascii=False)}")
    return ", ".join(parts)


def _observed(observed: Any) -> str:
    if isinstance(observed, dict) and "unexpected_count" in observed:
        text = f"{observed['unexpected_count']} unexpected of {observed.get('element_count')}"
        if observed.get("examples"):
            text += f"; e.g. {json.dumps(observed['examples'], default=str, ensure_ascii=False)}"
        return text
    return observed if isinstance(observed, str) else json.dumps(observed, default=str, ensure_ascii=False)


def _expectations_table(number: int, run: SuiteRun) -> str:
    rows = "".join(
        f"<tr><td>{_e(o.expectation)}</td><td>{_e(o.column or '')}</td>"
        f'<td class="value">{_e(_arguments(o))}</td><td class="value">{_e(_observed(o.observed))}</td>'
        f"<td>{_badge(o.success)}</td></tr>"
        for o in run.outcomes
    )
    return (
        f'<h2 id="v{number}">{_e(run.suite)} {_badge(run.success)}</h2>\n'
        f'<p class="meta">rows per split: {_e(_rows(run))}; run {_e(run.run_time)}</p>\n'
        "<table><tr><th>expectation</th><th>column</th><th>arguments</th><th>observed</th><th>result</th></tr>"
        f"{rows}</table>\n"
    )


def _problems_table(context: ReportContext) -> str:
    if not context.problems:
        return ""
    rows = "".join(
        f'<tr><td class="value">{_e(p.file or "")}</td><td class="value">{_e(p.problem)}</td><td>{_e(p.fix)}</td></tr>'
        for p in context.problems
    )
    return f"<h2>Problems found</h2>\n<table><tr><th>file</th><th>problem</th><th>fix</th></tr>{rows}</table>\n"


def _index(runs: Sequence[SuiteRun], context: ReportContext) -> str:
    body = _header(runs, context) + _problems_table(context) + _splits_table(context) + _summary_table(runs)
    body += "".join(_expectations_table(number, run) for number, run in enumerate(runs, start=1))
    if context.ge_docs_href:
        body += (
            f'<p class="meta">Great Expectations\' own <a href="{_e(context.ge_docs_href)}">Data Docs</a>'
            " (they load their styling and scripts from the internet).</p>\n"
        )
    return _document(f"Data validation of {context.dataset_url}", body)


def _run_page(number: int, run: SuiteRun, context: ReportContext) -> str:
    body = _header([run], context) + _expectations_table(number, run)
    body += f'<p class="meta"><a href="{INDEX}">all validations</a></p>\n'
    return _document(f"{run.suite}: data validation of {context.dataset_url}", body)
