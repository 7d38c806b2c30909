"""The base of every step's typed result, and the result of a step the spec turns off.

Each step package owns its own result class (tasks/<step>/step.py); this module sits low in the import graph so
that all of them, the summary and the cache can share the base without importing one another.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

Figure = float | int | bool | str | None
"""One key figure of a step in summary.json."""
NOT_FIGURES = frozenset({"verdict_text", "reason"})
"""Scalar result fields that are no figures (the verdict has its own column; a reason is the row's note)."""


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

    def note(self) -> str:
        """What the summary says beside the figures (why a step was skipped); empty for most."""
        return ""

    def figures(self) -> dict[str, Figure]:
        """The step's key figures for summary.json: numbers as numbers, each name with its unit where it has one
        (`p99_e2e_ms`, `output_tokens_per_s`, `peak_bytes`); text only for what is text (a path, a state). By
        default the result's scalar fields; a step whose figures sit deeper says which."""
        return {
            name: value
            for name, value in self.model_dump().items()
            if name not in NOT_FIGURES and (value is None or isinstance(value, int | float | str | bool))
        }

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

    def figures(self) -> dict[str, Figure]:
        """None: a skipped step measured nothing (the note says why)."""
        return {}

    def note(self) -> str:
        """Why it was skipped."""
        return self.summary()
