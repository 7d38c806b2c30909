"""The offline report pages: self-contained (no external reference, no script) and escaping untrusted text."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from validation.data import ExpectationOutcome, SuiteRun
from validation.data_report import INDEX, MAX_VALUE_CHARS, ReportContext, page_name, render_pages

HOSTILE = "</td><script>alert(1)</script><img src=x onerror=alert(2)>"
QUOTE = '"><a href="https://evil.example/x">'
LINK = "see https://example.com/style.css and http://cdn.example/x.js"


class _Page(HTMLParser):
    """Tags, attributes, style sheets and text of one page."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.styles: list[str] = []
        self.text: list[str] = []
        self._in_style = False
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        (self.styles if self._in_style else self.text).append(data)


def _runs() -> list[SuiteRun]:
    return [
        SuiteRun(
            suite="documents",
            rows_per_split={"all": 3},
            run_time="2026-01-02T03:04:05+00:00",
            outcomes=[
                ExpectationOutcome("expect_column_mean_to_be_between", "is_duplicate", {"max_value": 0.5}, 0.25, True),
                ExpectationOutcome(
                    "expect_column_values_to_be_in_set",
                    f"col{HOSTILE}",
                    {"column": f"col{HOSTILE}", "value_set": [QUOTE]},
                    {"unexpected_count": 2, "element_count": 3, "examples": [HOSTILE, LINK]},
                    False,
                ),
            ],
        ),
        SuiteRun(f"dataset_{HOSTILE}", {"train": 2, "val": 1}, "2026-01-02T03:04:06+00:00", []),
    ]


def _context() -> ReportContext:
    return ReportContext(
        dataset_url=f"/data/{QUOTE}{HOSTILE}/ds",
        splits={"train": {"docs": 2, "tokens": 20}, "val": {"docs": 1, "tokens": 9}},
        generated_at="2026-01-02T03:04:07+00:00",
        ge_docs_href="../data_docs/index.html",
    )


def test_pages_load_nothing_from_outside_and_run_no_script() -> None:
    pages = render_pages(_runs(), _context())
    assert set(pages) == {INDEX, page_name(1, _runs()[0]), page_name(2, _runs()[1])}
    for name, page in pages.items():
        parsed = _Page(page)
        tags = {tag for tag, _ in parsed.tags}
        assert not tags & {"script", "link", "img", "iframe", "object", "embed", "base"}, name
        for tag, attrs in parsed.tags:
            for key in ("href", "src", "action"):
                value = attrs.get(key)
                if value is not None:
                    assert "://" not in value and not value.startswith("//"), (name, tag, value)
            assert not any(key.startswith("on") for key in attrs), (name, tag, attrs)
        style = "".join(parsed.styles)
        assert style and "url(" not in style and "@import" not in style
        csp = [a["content"] for t, a in parsed.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
        assert csp == ["default-src 'none'; style-src 'unsafe-inline'"], name


def test_hostile_corpus_text_and_file_names_are_escaped_and_shown_as_text() -> None:
    pages = render_pages(_runs(), _context())
    for name, page in pages.items():
        assert HOSTILE not in page and QUOTE not in page, name
        text = "".join(_Page(page).text)
        assert f"/data/{QUOTE}{HOSTILE}/ds" in text, name  # the file name reads as it is
    index_text = "".join(_Page(pages[INDEX]).text)
    assert f"col{HOSTILE}" in index_text and f"dataset_{HOSTILE}" in index_text
    assert "2 unexpected of 3" in index_text and LINK in index_text
    assert re.fullmatch(r"02-dataset_[A-Za-z0-9_-]+\.html", page_name(2, _runs()[1]))


def test_the_index_lists_each_expectation_with_its_arguments_observed_value_and_verdict() -> None:
    page = _Page(render_pages(_runs(), _context())[INDEX])
    text = " ".join(page.text)
    for expected in (
        "expect_column_mean_to_be_between",
        "is_duplicate",
        "max_value=0.5",
        "0.25",
        "all 3",
        "train 2, val 1",
        "2026-01-02T03:04:05+00:00",
    ):
        assert expected in text
    badges = [a["class"] for t, a in page.tags if t == "span" and "badge" in (a.get("class") or "")]
    # pass: the second run (summary, heading) and one expectation; fail: overall, the first run twice, one expectation
    assert badges.count("badge pass") == 3 and badges.count("badge fail") == 4


def test_long_observed_text_is_cut() -> None:
    run = SuiteRun("documents", {"all": 1}, "t", [ExpectationOutcome("e", "c", {}, "x" * 10_000, True)])
    page = render_pages([run], _context())[INDEX]
    assert "x" * MAX_VALUE_CHARS + "…" in page and "x" * (MAX_VALUE_CHARS + 1) not in page
