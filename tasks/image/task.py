"""Prefect task `build_image`: the image step's `run`, retried only on transient registry errors."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.errors import retry_on_transient
from tasks.image.build import ImageResult, image_markdown
from tasks.image.step import ARTIFACT, NO_IMAGE, ImageInputs, ImageStepResult, run


def publish(result: ImageResult | None) -> None:
    """Log and publish what was built or found (or why nothing was: image: null)."""
    logger = get_run_logger()
    if result is None:
        logger.info("no image: %s", NO_IMAGE)
        create_markdown_artifact(key=ARTIFACT, markdown=f"# Training image\n\nskipped: {NO_IMAGE}\n")
        return
    logger.info("image %s: %s (%s)", result.reference or result.tag, result.status, result.reason)
    create_markdown_artifact(key=ARTIFACT, markdown=image_markdown(result), description=f"training image {result.tag}")


@task(
    name="build_image",
    retries=3,
    retry_delay_seconds=[5, 20, 60],
    retry_condition_fn=retry_on_transient,
    timeout_seconds=4 * 3600,
)
def build_image(inputs: ImageInputs) -> ImageStepResult:
    """Build and push the training image unless its tag exists; publish a summary; return image.json.

    `inputs.allow_skip` (a launcher that runs no image): where nothing can build, say why and let the job use the
    current environment.
    """
    return run(inputs, publish)
