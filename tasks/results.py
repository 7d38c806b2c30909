"""The base of every step's typed result, and the result of a step the spec turns off.

Each step package owns its own result class (tasks/<step>/step.py); this module sits low in the import graph so
that all of them, the summary and the cache can share the base without importing one another.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class StepResult(BaseModel):
    """What one step did: small, typed, serialisable (Prefect persists and caches it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @property
    def verdict(self) -> Literal["passed", "skipped"]:
        """`skipped` for a step that did not do its work, else `passed`."""
        return "passed"

    def summary(self) -> str:
        """The step's key figures in one line."""
        raise NotImplementedError

    def artifact_problem(self, inputs: Any) -> str | None:
        """What is wrong with the files this result points at, for a cached copy of it (None: nothing).

        `inputs` is the step's typed Inputs (the storage and registry to look with), or None where unknown."""
        return None


class SkippedResult(StepResult):
    """A step the spec turns off (for example `serve: null`)."""

    reason: str

    @property
    def verdict(self) -> Literal["passed", "skipped"]:
        """Always skipped."""
        return "skipped"

    def summary(self) -> str:
        """Why it was skipped."""
        return f"skipped: {self.reason}"
