"""Metric names in a PromQL expression (enough PromQL for alert rules and dashboard queries)."""

from __future__ import annotations

import re

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w.$])[A-Za-z_:][\w:]*")


def metric_names(expr: str) -> set[str]:
    """Every metric an expression selects: identifiers that are not functions, keywords, labels or variables."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values and other strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries
    text = _LABEL_LISTS.sub("", text)
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables
    names = set()
    for match in _NAME.finditer(text):
        word = match.group()
        if word.lower() in _KEYWORDS or text[match.end() :].lstrip().startswith("("):
            continue
        names.add(word)
    return names
