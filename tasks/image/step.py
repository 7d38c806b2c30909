"""The image step: its inputs from the spec, its plain `run`, its result and the constants its task uses."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from tasks.image.build import IMAGE_JSON, ImageResult, ensure_image
from tasks.image.config import ImageConfig
from tasks.image.registry import RegistryClient
from tasks.launch.registry import capabilities
from tasks.paths import DeploymentPaths
from tasks.results import Figure, StepResult

if TYPE_CHECKING:
    from tasks.spec import DeploymentSpec

TITLE = "image build"
ARTIFACT = "image-build"
NO_IMAGE = "the spec has image: null; the job runs from the nodes' current environment"


class ImageInputs(BaseModel):
    """What the image step reads: the image section, where image.json goes, and what the image must hold."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    image: ImageConfig | None
    record_dir: str
    """image.json, build.log and the build context (tasks.paths)."""
    with_s3: bool = False
    """The spec names S3 URLs: the image gets s3fs too."""
    allow_skip: bool = False
    """Where nothing can build, say why and let the job use the current environment: the scheduler's launcher
    runs the hosts' own Python, not an image (its capabilities say so)."""
    spec_digest: str | None = None

    @classmethod
    def of(cls, spec: DeploymentSpec, folder: str | None = None) -> ImageInputs:
        """The image step of `spec`, image.json and the build context in `folder` (default <reports>/image)."""
        return cls(
            image=spec.image,
            record_dir=DeploymentPaths.of(spec).image_dir(folder),
            with_s3=spec.uses_s3(),
            allow_skip=not capabilities(spec.cluster.scheduler).runs_image,
            spec_digest=spec.digest(),
        )

    def ensure(self) -> ImageResult:
        """Build and push the image unless its tag exists (`ensure_image`); image: null is the caller's case."""
        assert self.image is not None, "callers handle image: null"
        return ensure_image(
            self.image,
            Path(self.record_dir),
            with_s3=self.with_s3,
            spec_digest=self.spec_digest,
            allow_skip=self.allow_skip,
        )


class ImageStepResult(StepResult):
    """The image step: built, cached or skipped, with image.json's content when an image was considered."""

    status: Literal["built", "cached", "skipped"]
    reason: str
    record: dict[str, Any] | None = None
    """The content of image.json (tasks.image.build.ImageResult.to_json); None for image: null."""

    @classmethod
    def of(cls, image: ImageResult) -> ImageStepResult:
        """The result of an image build (or its cache hit)."""
        return cls(status=image.status, reason=image.reason, record=image.to_json())

    @property
    def verdict(self) -> Literal["passed", "skipped"]:
        """`skipped` when nothing was built or found."""
        return "skipped" if self.status == "skipped" else "passed"

    @property
    def job_image(self) -> str | None:
        """The reference the job runs: the pushed image by digest; None (the nodes' environment) otherwise."""
        if self.record is None or not self.record.get("pushed"):
            return None
        return self.record.get("reference_by_digest")

    def artifact_problem(self, inputs: Any) -> str | None:
        """image.json must be there and name the same image; a pushed image must still be in its registry."""
        if self.record is None:
            return None
        path = Path(self.record["record_dir"]) / IMAGE_JSON
        try:
            written = json.loads(path.read_text())
        except FileNotFoundError:
            return f"{path} is missing"
        except ValueError:
            return f"{path} is not whole (not JSON)"
        if written.get("content_sha256") != self.record.get("content_sha256"):
            return f"{path} names another image ({written.get('tag')})"
        image = getattr(inputs, "image", None)
        if self.record.get("pushed") and image is not None and image.registry_url:
            client = RegistryClient(image.registry_url, image.registry_insecure)
            if client.manifest(image.repository, self.record["tag"]) is None:
                return f"{self.record['reference']} is no longer in the registry"
        return None

    def figures(self) -> dict[str, Figure]:
        """Status and the image's reference (by digest where pushed)."""
        record = self.record or {}
        return {"status": self.status, "reference": record.get("reference_by_digest") or record.get("reference")}

    def note(self) -> str:
        """Why it was built, reused or skipped."""
        return self.reason

    def summary(self) -> str:
        """Status, the image's reference and why."""
        record = self.record or {}
        reference = record.get("reference_by_digest") or record.get("reference") or "-"
        return f"{self.status}: `{reference}`; {self.reason}"


def run(inputs: ImageInputs, publish: Callable[[ImageResult | None], None] | None = None) -> ImageStepResult:
    """Build and push the image unless its tag exists (skipped for image: null); hand what was built (None for
    image: null) to `publish`."""
    if inputs.image is None:
        if publish is not None:
            publish(None)
        return ImageStepResult(status="skipped", reason=NO_IMAGE)
    result = inputs.ensure()
    if publish is not None:
        publish(result)
    return ImageStepResult.of(result)
