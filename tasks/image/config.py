"""The `image` section of the spec: base image, builder, registry, pinned extras, environment and user."""

from __future__ import annotations

import re
from typing import Literal

from packaging.requirements import InvalidRequirement, Requirement
from pydantic import Field, field_validator

from training.config import StrictModel

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# An image reference: [host[:port]/]path[:tag][@sha256:digest], as registries and `FROM` accept it.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REF = re.compile(
    rf"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]{{1,5}})?/)?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?"
)
_SECRET_WORDS = ("secret", "password", "passwd", "token", "credential", "access_key", "private_key")
# Set by the Containerfile itself; a spec value would silently lose or break the build.
_RESERVED_ENV = ("PATH", "HOME", "PYTHONPATH")
# The fields that change what is inside the image (the spec-hash label covers these, not where it is pushed).
IMAGE_SHAPING_FIELDS = ("base_image", "install_payload_dependencies", "extra_requirements", "env", "user", "uid")


def image_reference(value: str, example: str) -> str:
    """`value` if it is an image reference ([registry[:port]/]name[:tag][@sha256:digest]); else ValueError."""
    if not IMAGE_REF.fullmatch(value):
        raise ValueError(
            f"{value!r} is not an image reference; write [registry[:port]/]name[:tag][@sha256:digest], e.g. {example}"
        )
    return value


class ImageConfig(StrictModel):
    """The training image: what it is built from, by which builder, and where it is pushed."""

    base_image: str = Field(
        default="docker.io/pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime",
        min_length=1,
        description="Base image with Python 3, pip and PyTorch (torchrun), e.g. nvcr.io/nvidia/pytorch:25.01-py3. "
        "Pin it by digest (name@sha256:...) for builds that stay identical when the tag moves upstream.",
    )
    builder: Literal["auto", "docker", "podman", "buildah"] = Field(
        default="auto",
        description="auto: the first that works of a Docker engine (Python docker SDK), podman, buildah; or force one.",
    )
    pull_policy: Literal["missing", "never"] = Field(
        default="missing",
        description="missing: pull the base image when the builder's store lacks it; never: offline, the base "
        "must already be in the store (load it with `buildah pull oci-archive:FILE`, `podman load` or `docker load`).",
    )
    registry_url: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[a-z0-9._/-]+)?$",
        description="Registry host[:port][/namespace] the image is pushed to, e.g. registry.example.com:5000/ml "
        "(no scheme); None = keep it in the builder's local store (local runs).",
    )
    registry_insecure: bool = Field(
        default=False, description="Talk plain HTTP to the registry, without TLS (a test registry on 127.0.0.1)."
    )
    repository: str = Field(
        default="transformer-deploy/train",
        pattern=r"^[a-z0-9]+([._-][a-z0-9]+)*(/[a-z0-9]+([._-][a-z0-9]+)*)*$",
        description="Repository name under the registry; the tag is derived from the image's content.",
    )
    install_payload_dependencies: bool = Field(
        default=True,
        description="True: pip installs numpy, fsspec, pydantic (+ s3fs when a spec URL is s3://) and their "
        "dependencies, pinned to the versions installed where tdeploy runs; False: the base image provides them. "
        "PyTorch always comes from the base image.",
    )
    extra_requirements: list[str] = Field(
        default_factory=list,
        description="More pip packages for the image, each pinned as name==version (e.g. nvidia-ml-py==12.560.30).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables baked into the image, e.g. NCCL_DEBUG: WARN, NCCL_IB_DISABLE: '1' "
        "(no secrets: those come from the scheduler at run time).",
    )
    user: str = Field(
        default="trainer", pattern=r"^[a-z_][a-z0-9_-]{0,31}$", description="Non-root user the job runs as."
    )
    uid: int = Field(
        default=1000, ge=1, le=2**31 - 1, description="Its numeric uid and gid (an existing account is reused)."
    )
    isolation: Literal["chroot", "oci"] = Field(
        default="chroot",
        description="buildah/podman: how RUN steps are isolated; chroot needs no OCI runtime or cgroups.",
    )
    storage_dir: str | None = Field(
        default=None,
        description="buildah/podman: a private container store (vfs driver; storage/ and run/ inside); "
        "None = the builder's default store.",
    )
    build_timeout_s: float = Field(
        default=3600.0, gt=0, le=7 * 86400, allow_inf_nan=False, description="Longest a build, pull or push may take."
    )

    @field_validator("base_image")
    @classmethod
    def _image_reference(cls, value: str) -> str:
        return image_reference(value, "nvcr.io/nvidia/pytorch:25.01-py3")

    @field_validator("storage_dir")
    @classmethod
    def _one_line(cls, value: str | None) -> str | None:
        if value is not None and _CONTROL.search(value):
            raise ValueError(f"{value!r} contains a control character (newline, tab, NUL...); remove it")
        return value

    @field_validator("extra_requirements")
    @classmethod
    def _pinned(cls, value: list[str]) -> list[str]:
        for requirement in value:
            problem = _pin_problem(requirement)
            if problem:
                raise ValueError(f"{requirement!r} {problem}")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a valid variable name; use letters, digits and _ (NCCL_DEBUG)")
            if name in _RESERVED_ENV:
                raise ValueError(f"{name!r} is set by the image itself; remove it")
            if any(word in name.lower() for word in _SECRET_WORDS):
                raise ValueError(
                    f"{name!r} looks like a credential; secrets never sit in specs or images: "
                    "pass it at run time from the scheduler's secret store"
                )
            if _CONTROL.search(text):
                raise ValueError(f"{name}: the value must be one line without control characters (newline, NUL...)")
        return value


def _pin_problem(requirement: str) -> str | None:
    """Why `requirement` is not an exact pin, or None."""
    try:
        parsed = Requirement(requirement)
    except InvalidRequirement as err:
        return f"is not a pip requirement ({err}); write name==version"
    specs = list(parsed.specifier)
    if parsed.url or len(specs) != 1 or specs[0].operator not in ("==", "===") or "*" in specs[0].version:
        return f"must be pinned as name==version, e.g. {parsed.name}==1.2.3"
    return None
