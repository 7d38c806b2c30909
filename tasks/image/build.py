"""The image-build step: render, build (unless the tag exists), push, and record the result in image.json."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tasks.errors import UserError
from tasks.image.builders import Builder, select_builder
from tasks.image.config import ImageConfig
from tasks.image.containerfile import BuildInputs, render
from tasks.image.errors import BaseImageMissing, CannotBuildHere
from tasks.image.payload import build_wheel, payload_source, pinned_dependencies, source_revision
from tasks.image.registry import RegistryClient

logger = logging.getLogger(__name__)

IMAGE_JSON = "image.json"
BUILD_LOG = "build.log"
CONTEXT_DIR = "context"


@dataclass
class ImageResult:
    """What the step did and the image the job submission will use (written as image.json).

    `digest` is the registry's manifest digest once pushed (the local store's before);
    `size_bytes` is the compressed size in the registry once pushed (uncompressed locally before);
    `build_time_s` is the builder's time (0 on a cache hit), `step_time_s` the whole step's.
    """

    status: Literal["built", "cached", "skipped"]
    reason: str
    tag: str
    reference: str | None
    digest: str | None
    image_id: str | None
    builder: str | None
    registry: str | None
    pushed: bool
    size_bytes: int | None
    build_time_s: float
    step_time_s: float
    steps: int | None
    cached_steps: int | None
    labels: dict[str, str]
    base_image: str
    payload_wheel: str
    payload_sha256: str
    requirements: list[str]
    content_sha256: str
    spec_digest: str | None
    record_dir: str
    finished_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    @property
    def reference_by_digest(self) -> str | None:
        """`repository@sha256:...`: what a pushed image is pulled by, immune to tag moves."""
        if not (self.pushed and self.reference and self.digest):
            return None
        return f"{self.reference.rsplit(':', 1)[0]}@{self.digest}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the content of image.json)."""
        return {**asdict(self), "reference_by_digest": self.reference_by_digest}


def image_requirements(cfg: ImageConfig, with_s3: bool) -> list[str]:
    """Pinned requirements the image installs: the payload's dependencies (if asked) and the spec's extras."""
    pins: dict[str, str] = {}
    if cfg.install_payload_dependencies:
        try:
            found = pinned_dependencies(with_s3)
        except LookupError as err:
            raise UserError(
                f"image.install_payload_dependencies=true: {err}",
                "install the project with its dependencies (bash .ci/setup), or set it to false "
                "when the base image provides them",
            ) from err
        pins.update({canonicalize_name(Requirement(r).name): r for r in found})
    # The spec's own pins win over the versions found here.
    pins.update({canonicalize_name(Requirement(r).name): r for r in cfg.extra_requirements})
    return [pins[name] for name in sorted(pins)]


def prepare_inputs(cfg: ImageConfig, with_s3: bool = False, source: Path | None = None) -> BuildInputs:
    """Build the payload wheel and render the Containerfile: everything the tag is computed from."""
    source = source or payload_source()
    wheel = build_wheel(source)
    return render(cfg, wheel, image_requirements(cfg, with_s3), source_revision(source))


def ensure_image(
    cfg: ImageConfig,
    record_dir: Path,
    *,
    with_s3: bool = False,
    spec_digest: str | None = None,
    source: Path | None = None,
    allow_skip: bool = False,
) -> ImageResult:
    """Build and push the training image unless its content-addressed tag exists; write image.json.

    With `allow_skip` (local runs) a machine without a builder or without the base
    image gets a `skipped` result that says why, instead of an error.
    """
    started = time.monotonic()
    record_dir.mkdir(parents=True, exist_ok=True)
    inputs = prepare_inputs(cfg, with_s3, source)
    registry = RegistryClient(cfg.registry_url, cfg.registry_insecure) if cfg.registry_url else None

    def result(status: Literal["built", "cached", "skipped"], reason: str, **values: Any) -> ImageResult:
        fields: dict[str, Any] = {
            "reference": None,
            "digest": None,
            "image_id": None,
            "builder": None,
            "pushed": False,
            "size_bytes": None,
            "build_time_s": 0.0,
            "steps": None,
            "cached_steps": None,
            "labels": inputs.labels,
        }
        fields.update(values)
        out = ImageResult(
            status=status,
            reason=reason,
            tag=inputs.tag,
            registry=cfg.registry_url,
            base_image=cfg.base_image,
            payload_wheel=inputs.wheel.filename,
            payload_sha256=inputs.wheel.sha256,
            requirements=inputs.requirements,
            content_sha256=inputs.content_sha256,
            spec_digest=spec_digest,
            record_dir=str(record_dir),
            step_time_s=round(time.monotonic() - started, 3),
            **fields,
        )
        (record_dir / IMAGE_JSON).write_text(json.dumps(out.to_json(), indent=2) + "\n")
        logger.info("image %s: %s (%s)", out.reference or inputs.tag, status, reason)
        return out

    if registry is not None:
        # A tag in the registry needs no builder at all: this also works on a machine that cannot build.
        remote = registry.manifest(cfg.repository, inputs.tag)
        if remote is not None:
            return result(
                "cached",
                f"tag {inputs.tag} is already in registry {cfg.registry_url}: nothing to build or push",
                reference=registry.reference(cfg.repository, inputs.tag),
                digest=remote.digest,
                image_id=remote.config_digest,
                pushed=True,
                size_bytes=remote.size_bytes,
            )
    try:
        builder = select_builder(cfg)
    except CannotBuildHere as err:
        if allow_skip:
            return result("skipped", f"{err}; the local run uses the current environment instead")
        raise
    if registry is not None:
        reference = registry.reference(cfg.repository, inputs.tag)
    else:
        reference = builder.local_reference(cfg.repository, inputs.tag)

    local = builder.inspect(reference)
    values: dict[str, Any] = {"reference": reference, "builder": builder.version()}
    if local is not None:
        status: Literal["built", "cached"] = "cached"
        reason = f"tag {inputs.tag} is already in {builder.name}'s local store: nothing to build"
    else:
        try:
            _ensure_base(builder, cfg)
        except CannotBuildHere as err:
            if allow_skip:
                return result("skipped", f"{err}; the local run uses the current environment instead", **values)
            raise
        context = inputs.write_context(record_dir / CONTEXT_DIR)
        output = builder.build(context, reference, record_dir / BUILD_LOG, cfg.build_timeout_s)
        local = builder.inspect(reference)
        assert local is not None, f"{builder.name} reported success but has no {reference}"
        status = "built"
        reason = (
            f"built by {builder.name}: {output.steps} steps, {output.cached_steps} from the layer cache; "
            f"log {record_dir / BUILD_LOG}"
        )
        values.update(build_time_s=round(output.seconds, 3), steps=output.steps, cached_steps=output.cached_steps)

    values.update(image_id=local.image_id, digest=local.digest, size_bytes=local.size_bytes, labels=local.labels)
    if registry is not None:
        pushed_digest = builder.push(reference, cfg.registry_insecure, cfg.build_timeout_s)
        remote = registry.manifest(cfg.repository, inputs.tag)
        if remote is None:
            raise UserError(
                f"pushed {reference} but registry {cfg.registry_url} does not list the tag",
                "check that image.registry_url points at the registry the builder pushes to",
            )
        if pushed_digest and remote.digest != pushed_digest:
            logger.warning("registry reports digest %s, %s wrote %s", remote.digest, builder.name, pushed_digest)
        values.update(digest=remote.digest, pushed=True, size_bytes=remote.size_bytes)
        reason += f"; pushed to {cfg.registry_url}"
    return result(status, reason, **values)


def _ensure_base(builder: Builder, cfg: ImageConfig) -> None:
    """Make sure the base image is in the builder's store, pulling it only when the pull policy allows."""
    if builder.inspect(cfg.base_image) is not None:
        return
    if cfg.pull_policy == "never":
        raise BaseImageMissing(
            cfg.base_image,
            builder.name,
            "not in the local store, and image.pull_policy=never forbids pulling it",
            f"load it into {builder.name}'s store first (`buildah pull oci-archive:FILE`, `podman load -i FILE`, "
            "`docker load -i FILE`) or set image.pull_policy: missing",
        )
    logger.info("pulling base image %s with %s", cfg.base_image, builder.name)
    builder.pull(cfg.base_image, cfg.build_timeout_s)


def image_markdown(result: ImageResult) -> str:
    """The human summary of one image build (the task's markdown artifact)."""
    size = f"{result.size_bytes / 2**20:.1f} MiB" if result.size_bytes is not None else "-"
    rows = [
        ("status", f"**{result.status}**"),
        ("why", result.reason.replace("\n", " ")),
        ("reference", f"`{result.reference or '-'}`"),
        ("digest", f"`{result.digest or '-'}`"),
        ("pull by digest", f"`{result.reference_by_digest or '-'}`"),
        ("image ID", f"`{result.image_id or '-'}`"),
        ("builder", result.builder or "-"),
        ("size", size),
        (
            "build time",
            f"{result.build_time_s:.1f} s"
            + (f" ({result.cached_steps}/{result.steps} steps cached)" if result.steps else ""),
        ),
        ("base image", f"`{result.base_image}`"),
        ("payload", f"`{result.payload_wheel}` sha256 `{result.payload_sha256[:16]}`"),
        ("pinned requirements", ", ".join(f"`{r}`" for r in result.requirements) or "none"),
        ("record", f"`{Path(result.record_dir) / 'image.json'}`"),
    ]
    labels = "\n".join(f"| `{k}` | `{v}` |" for k, v in sorted(result.labels.items()))
    return (
        f"# Training image `{result.tag}`\n\n| | |\n|---|---|\n"
        + "\n".join(f"| {k} | {v} |" for k, v in rows)
        + f"\n\n## Labels\n\n| label | value |\n|---|---|\n{labels}\n"
    )
