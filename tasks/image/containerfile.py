"""Render the Containerfile and lay out the build context; derive the content-addressed tag.

Steps are ordered by how often they change, so a payload-only change rebuilds only
the two payload layers (copy the wheel, install it) and the two metadata steps
after them (labels, user); every earlier step comes from the layer cache.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import UserError
from tasks.image.config import IMAGE_REF, IMAGE_SHAPING_FIELDS, ImageConfig
from tasks.image.payload import PayloadWheel

LABEL_PREFIX = "io.transformer-deploy"
CONTAINERFILE = "Containerfile"
REQUIREMENTS = "requirements.txt"
PAYLOAD_DIR = "payload"
INSTALL_DIR = "/opt/transformer-deploy"
WORKDIR = "/workspace"
# Default command: one process on one node; job submission replaces it with the cluster's torchrun arguments.
DEFAULT_CMD = ["--standalone", "--nproc-per-node=1", "-m", "training.train", "--config", f"{WORKDIR}/run.json"]
# pip must leave nothing behind that depends on when it ran: no caches, no bytecode (its header stores mtimes).
# Every word is shell-quoted (the base image's /bin/sh runs it; exec form would need env(1) on the image's PATH).
_PIP = [
    "PYTHONDONTWRITEBYTECODE=1", "PIP_BREAK_SYSTEM_PACKAGES=1", "PIP_ROOT_USER_ACTION=ignore",
    "python3", "-m", "pip", "install", "--no-cache-dir", "--no-compile", "--disable-pip-version-check",
]  # fmt: skip
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class BuildInputs:
    """Everything that determines the image, rendered; `tag` is a hash of exactly these."""

    containerfile: str
    requirements: list[str]
    wheel: PayloadWheel
    labels: dict[str, str]

    @property
    def content_sha256(self) -> str:
        """sha256 over the rendered Containerfile, the payload wheel and the pinned requirements."""
        digest = hashlib.sha256()
        for part in (self.containerfile, self.wheel.sha256, "\n".join(self.requirements)):
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()

    @property
    def tag(self) -> str:
        """`<payload version>-<first 16 hex of content_sha256>`."""
        return f"{self.wheel.version}-{self.content_sha256[:16]}"

    def write_context(self, folder: Path) -> Path:
        """Write Containerfile, requirements.txt and payload/<wheel> into a fresh `folder`."""
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        (folder / CONTAINERFILE).write_text(self.containerfile)
        (folder / REQUIREMENTS).write_text("".join(f"{r}\n" for r in self.requirements))
        self.wheel.write(folder / PAYLOAD_DIR)
        return folder


def _quote(value: str) -> str:
    """A Containerfile double-quoted string; `$` is escaped so values are taken literally."""
    if _CONTROL.search(value):  # a newline would end the instruction and start another
        raise UserError(f"{value!r} has a control character and cannot go into the Containerfile", "remove it")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def image_labels(cfg: ImageConfig, wheel: PayloadWheel, revision: str) -> dict[str, str]:
    """OCI labels: source revision, base, payload version and hash, and the hash of the image-shaping spec fields."""
    shaping = cfg.model_dump_json(include=set(IMAGE_SHAPING_FIELDS))
    spec_sha = hashlib.sha256(shaping.encode()).hexdigest()
    return {
        "org.opencontainers.image.title": "transformer-deploy training",
        "org.opencontainers.image.version": wheel.version,
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.base.name": cfg.base_image,
        f"{LABEL_PREFIX}.image-spec-sha256": spec_sha,
        f"{LABEL_PREFIX}.payload-sha256": wheel.sha256,
    }


def render(cfg: ImageConfig, wheel: PayloadWheel, requirements: list[str], revision: str) -> BuildInputs:
    """The Containerfile for `cfg`, with the payload wheel and pinned requirements it installs."""
    labels = image_labels(cfg, wheel, revision)
    env = {"PYTHONUNBUFFERED": "1", **dict(sorted(cfg.env.items()))}
    bad = [name for name in env if not _ENV_NAME.fullmatch(name)]
    if not IMAGE_REF.fullmatch(cfg.base_image) or bad or not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", cfg.user):
        # These are words of the Containerfile that no quoting covers; the spec refuses them first.
        raise UserError(f"image: base_image, user or env names {bad} cannot be written safely", "fix the spec")
    user, uid, home = cfg.user, int(cfg.uid), f"/home/{cfg.user}"
    lines = [
        "# Rendered by transformer-deploy from the spec's image section; edit the spec, not this file.",
        f"FROM {cfg.base_image}",
        "ENV " + " \\\n    ".join(f"{name}={_quote(value)}" for name, value in env.items()),
        f"WORKDIR {WORKDIR}",
        'ENTRYPOINT ["torchrun"]',
        f"CMD {json.dumps(DEFAULT_CMD)}",
        "# Non-root user, written directly so that the layer does not depend on the build date or the base's tools.",
        "RUN set -eu; "
        f"grep -q '^[^:]*:[^:]*:{uid}:' /etc/passwd "
        f"|| echo {shlex.quote(f'{user}:x:{uid}:{uid}::{home}:/bin/sh')} >> /etc/passwd; "
        f"grep -q '^[^:]*:[^:]*:{uid}:' /etc/group || echo {shlex.quote(f'{user}:x:{uid}:')} >> /etc/group; "
        f"mkdir -p {shlex.quote(home)} {WORKDIR}; chown {uid}:{uid} {shlex.quote(home)} {WORKDIR}",
    ]
    if requirements:
        lines += [
            f"COPY {REQUIREMENTS} {INSTALL_DIR}/{REQUIREMENTS}",
            "RUN " + shlex.join([*_PIP, "--requirement", f"{INSTALL_DIR}/{REQUIREMENTS}"]),
        ]
    lines += [
        f"COPY {PAYLOAD_DIR}/{wheel.filename} {INSTALL_DIR}/{PAYLOAD_DIR}/{wheel.filename}",
        "RUN " + shlex.join([*_PIP, "--no-deps", "--no-index", f"{INSTALL_DIR}/{PAYLOAD_DIR}/{wheel.filename}"]),
        "LABEL " + " \\\n      ".join(f"{key}={_quote(value)}" for key, value in labels.items()),
        f"USER {cfg.uid}:{cfg.uid}",
        "",
    ]
    return BuildInputs(containerfile="\n".join(lines), requirements=requirements, wheel=wheel, labels=labels)
