"""Prefect task `build_image`: thin wrapper over `ensure_image`, retried only on transient registry errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.errors import retry_on_transient
from tasks.image.build import ensure_image_for_spec, image_markdown
from tasks.spec import DeploymentSpec


@task(
    name="build_image",
    retries=3,
    retry_delay_seconds=[5, 20, 60],
    retry_condition_fn=retry_on_transient,
    timeout_seconds=4 * 3600,
)
def build_image(spec: DeploymentSpec, record_dir: str | None = None) -> dict[str, Any]:
    """Build and push the spec's training image unless its tag exists; publish a summary; return image.json."""
    logger = get_run_logger()
    if spec.image is None:
        reason = "the spec has image: null; the job runs from the nodes' current environment"
        logger.info("no image: %s", reason)
        create_markdown_artifact(key="image-build", markdown=f"# Training image\n\nskipped: {reason}\n")
        return {"status": "skipped", "reason": reason}
    result = ensure_image_for_spec(spec, Path(record_dir) if record_dir else None)
    logger.info("image %s: %s (%s)", result.reference or result.tag, result.status, result.reason)
    create_markdown_artifact(
        key="image-build", markdown=image_markdown(result), description=f"training image {result.tag}"
    )
    return result.to_json()
