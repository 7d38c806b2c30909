"""The data step's typed outputs: the error that refuses a dataset, and the result of a dataset given by URL."""

from __future__ import annotations

import pickle

from tasks.errors import UserError
from tasks.prepare.existing import CheckedDataset
from tasks.prepare.pipeline import DataValidationError
from tasks.prepare.step import DataInputs, DataResult
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from validation.data import DataProblem, FailedExpectation

PROBLEM = DataProblem("train/tokens-00000.bin", "token id 5000 at position 7 of train/tokens-00000.bin", "use X")


def test_a_refusal_names_each_problem_with_its_fix_then_the_rule_it_broke_and_where_the_report_is() -> None:
    failed = [FailedExpectation("dataset_shards", "expect_column_values_to_be_between", "max_id", {}, 5000)]
    err = DataValidationError("data.dataset_url=/d", failed, "/r/v.json", "/r/index.html", [PROBLEM], fix="retry")
    assert isinstance(err, UserError)  # never retried
    assert str(err) == (
        "data.dataset_url=/d: data validation failed: token id 5000 at position 7 of train/tokens-00000.bin; use X "
        "[failed expectations: dataset_shards: expect_column_values_to_be_between(max_id) failed; observed 5000]; "
        "retry (report: /r/v.json; page: /r/index.html)"
    )


def test_a_refusal_survives_pickling_as_prefect_stores_a_failed_task() -> None:
    err = DataValidationError("dataset /d", [], None, problems=[PROBLEM], fix="rebuild it")
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.problems == [PROBLEM] and again.fix == err.fix


def test_a_given_dataset_reads_as_given_with_its_verdict_in_the_summary() -> None:
    checked = CheckedDataset(
        dataset_url="/data/ds",
        sources=["/data/megatron/corpus"],
        key="k",
        cached=True,
        splits={"train": {"docs": 5, "tokens": 1234}},
        vocab_size=257,
        tokenizer_sha256=None,
        validation={"success": True, "evaluated_expectations": 10},
        validation_url="/r/v.json",
        data_docs_url="/r/index.html",
    )
    result = DataResult.of_checked(checked)
    assert result.given and result.reused and result.cached_verdict and result.data_docs_url == "/r/index.html"
    assert result.sources == ["/data/megatron/corpus"]
    assert result.summary() == "`/data/ds` (given): train 1,234 tokens / 5 docs; validation passed (cached verdict)"


def test_the_cli_and_the_flow_take_the_data_steps_inputs_from_one_place() -> None:
    data = deep_merge(
        TINY_SPEC, {"data": {"dataset_url": "/data/ds"}, "checkpoint": {"url": "/c"}, "run": {"output_url": "/o"}}
    )
    spec = parse_spec({**data, "deployment_dir": "/deploy/tiny"})
    expected = DataInputs(data=spec.data, vocab_size=257, storage=spec.storage, reports_dir="/deploy/tiny")
    assert DataInputs.of(spec) == expected
