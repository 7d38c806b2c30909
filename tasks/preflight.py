"""Preflight: every path and URL of a spec checked for existence or writability before any work starts."""

from __future__ import annotations

from tasks.spec import DeploymentSpec


def preflight(spec: DeploymentSpec) -> None:
    """Raise SpecError naming every path or URL of `spec` that cannot be read or written, with the fix."""
