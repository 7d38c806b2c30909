"""Preflight against a real S3 endpoint (moto's server): a missing bucket is a spec error, a dead endpoint transient."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3
import pytest

from tasks.errors import TransientError
from tasks.preflight import preflight
from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from tests.integration.nodes.conftest import free_port

pytestmark = pytest.mark.integration


def _spec(tmp_path: Path, tiny_dataset: str, endpoint: str, checkpoint_url: str, dataset_url: str | None = None) -> Any:
    return parse_spec(
        deep_merge(
            TINY_SPEC,
            {
                "data": {"dataset_url": dataset_url or tiny_dataset},
                "checkpoint": {"url": checkpoint_url},
                "run": {"output_url": str(tmp_path / "out")},
                "storage": {"s3_endpoint_url": endpoint},
            },
        )
    )


def test_a_writable_bucket_passes_and_a_missing_bucket_or_object_is_refused_with_its_field(
    tmp_path: Path, tiny_dataset: str, s3_endpoint: str, s3_bucket: str
) -> None:
    preflight(_spec(tmp_path, tiny_dataset, s3_endpoint, f"s3://{s3_bucket}/ckpt"))
    listed = boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=s3_bucket)
    assert listed.get("Contents", []) == [], "the write probe is deleted"
    spec = _spec(tmp_path, tiny_dataset, s3_endpoint, "s3://no-such-bucket-x/ckpt", f"s3://{s3_bucket}/no-such-dataset")
    with pytest.raises(SpecError) as err:
        preflight(spec)
    problems = err.value.problems
    assert any(
        p.startswith("checkpoint.url=s3://no-such-bucket-x/ckpt: the bucket no-such-bucket-x does not exist")
        for p in problems
    ), problems
    assert any(p.startswith(f"data.dataset_url=s3://{s3_bucket}/no-such-dataset: does not exist") for p in problems)


@pytest.mark.timeout(180)
def test_an_endpoint_that_refuses_connections_is_transient(tmp_path: Path, tiny_dataset: str, s3_endpoint: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(TransientError) as err:
        preflight(_spec(tmp_path, tiny_dataset, dead, "s3://some-bucket/ckpt"))
    assert "checkpoint.url=s3://some-bucket/ckpt: storage did not answer" in str(err.value)
    assert not isinstance(err.value, SpecError)
