"""Spec errors in words a user acts on: a removed field says what replaced it (and that replacement is a valid
spec), the deployment name's rule is said in words, not as a regex."""

from __future__ import annotations

import asyncio
import pickle
import re

import pytest
import yaml
from prefect.states import exception_to_failed_state

from tasks.errors import UserError, retry_on_transient
from tasks.logs import is_user_error
from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge

BASE = deep_merge(TINY_SPEC, {"data": {"dataset_url": "/d"}, "checkpoint": {"url": "/c"}, "run": {"output_url": "/o"}})


def _problems(overrides: dict) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_spec(deep_merge(BASE, overrides))
    return caught.value.problems


def test_a_removed_field_says_what_replaced_it_and_the_replacement_validates() -> None:
    (line,) = _problems({"data": {"bootstrap": {"corpus": "stdlib-docstrings", "max_bytes": 1000000}}})
    assert line.startswith("data.bootstrap={...}: was removed; data.prepare replaced it")
    assert "not a known field" not in line
    suggested = yaml.safe_load(re.search(r"`(data: .*?)`", line).group(1))
    spec = parse_spec({**BASE, **suggested})
    assert spec.data.prepare is not None and spec.data.prepare.builtin_corpus == "python-docs"
    assert spec.data.prepare.tokenizer.kind == "bytes" and spec.data.dataset_url is None


def test_a_misspelt_field_is_still_called_unknown() -> None:
    (line,) = _problems({"data": {"bootstrp": {}}})
    assert line == "data.bootstrp={...}: is not a known field; remove it or check its spelling"


@pytest.mark.parametrize(("name", "example"), [("My Run", "my-run"), ("-llama_7b", "llama-7b"), ("", "my-run")])
def test_a_bad_name_is_explained_in_words_with_a_name_that_would_do(name: str, example: str) -> None:
    (line,) = _problems({"name": name})
    assert line.startswith("name=") and line.endswith(
        ": must be 1 to 63 lowercase letters, digits and '-', starting with a letter or digit (it names folders, "
        f"jobs and flow runs); e.g. {example}"
    )
    assert "^" not in line and "{0,62}" not in line
    assert parse_spec({**BASE, "name": example}).name == example


def test_a_spec_error_is_a_user_error_that_the_retry_rule_never_retries() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(deep_merge(BASE, {"name": "My Run"}))
    err = caught.value
    assert isinstance(err, UserError) and is_user_error(err)
    assert retry_on_transient(None, None, asyncio.run(exception_to_failed_state(exc=err))) is False
    back = pickle.loads(pickle.dumps(err))  # Prefect keeps a failed task's exception
    assert (back.source, back.problems, str(back)) == (err.source, err.problems, str(err))
    assert str(err).startswith("<spec>: invalid deployment spec:\n  - name=My Run: must be 1 to 63")
