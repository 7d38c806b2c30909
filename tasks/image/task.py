"""Prefect task `build_image`: thin wrapper over `ensure_image`, retried only on transient registry errors."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.deployment import ImageInputs, ImageStepResult
from tasks.errors import retry_on_transient
from tasks.image.build import image_markdown
from tasks.image.config import ImageConfig


@task(
    name="build_image",
    retries=3,
    retry_delay_seconds=[5, 20, 60],
    retry_condition_fn=retry_on_transient,
    timeout_seconds=4 * 3600,
)
def build_image(
    image: ImageConfig | None,
    record_dir: str,
    with_s3: bool = False,
    allow_skip: bool = False,
    spec_digest: str | None = None,
) -> ImageStepResult:
    """Build and push the training image unless its tag exists; publish a summary; return image.json.

    `allow_skip` (local runs): where nothing can build, say why and let the job use the current environment.
    """
    logger = get_run_logger()
    if image is None:
        reason = "the spec has image: null; the job runs from the nodes' current environment"
        logger.info("no image: %s", reason)
        create_markdown_artifact(key="image-build", markdown=f"# Training image\n\nskipped: {reason}\n")
        return ImageStepResult(status="skipped", reason=reason)
    result = ImageInputs(image, record_dir, with_s3, allow_skip, spec_digest).ensure()
    logger.info("image %s: %s (%s)", result.reference or result.tag, result.status, result.reason)
    create_markdown_artifact(
        key="image-build", markdown=image_markdown(result), description=f"training image {result.tag}"
    )
    return ImageStepResult.of(result)
