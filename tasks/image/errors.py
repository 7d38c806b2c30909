"""Why an image could not be built or pushed; each says the fix."""

from __future__ import annotations

from tasks.errors import TransientError, UserError


class CannotBuildHere(UserError):
    """This machine lacks what a build needs (a builder, the base image); local runs skip the step instead."""


class BuilderNotFound(CannotBuildHere):
    """No usable image builder (or not the one the spec forces)."""

    def __init__(self, builder: str, reasons: list[str]) -> None:
        super().__init__(
            f"image.builder={builder}: no usable image builder on this machine ({'; '.join(reasons)})",
            "install one: `apt-get install buildah` (daemonless, works unprivileged), `apt-get install podman`, "
            "or start a Docker engine; or set image.builder to one that is installed",
        )
        self.builder, self.reasons = builder, reasons


class BaseImageMissing(CannotBuildHere):
    """The base image is not in the builder's store and may not (or could not) be pulled."""

    def __init__(self, image: str, builder: str, detail: str, fix: str) -> None:
        super().__init__(f"image.base_image={image}: not available to {builder} ({detail})", fix)
        self.image, self.builder, self.detail = image, builder, detail


class BuildFailed(UserError):
    """The builder ran the Containerfile and a step failed; `log_tail` has the builder's last lines."""

    def __init__(self, builder: str, context: str, log_tail: str) -> None:
        super().__init__(
            f"{builder} could not build the image from {context}/Containerfile:\n{log_tail}",
            "read the failing step above (the base image needs python3 with pip, and /bin/sh)",
        )
        self.builder, self.context, self.log_tail = builder, context, log_tail


class RegistryUnavailable(TransientError):
    """The registry did not answer or answered with a server error: may pass, retried."""

    def __init__(self, registry: str, detail: str) -> None:
        super().__init__(
            f"registry {registry} is not reachable or failing ({detail})",
            "retrying; if it persists check image.registry_url and that the registry is up",
        )
        self.registry, self.detail = registry, detail


class RegistryRejected(UserError):
    """The registry refused the request (auth, name, TLS settings): retrying cannot help."""

    def __init__(self, registry: str, detail: str, fix: str) -> None:
        super().__init__(f"registry {registry} refused the request ({detail})", fix)
        self.registry, self.detail = registry, detail
