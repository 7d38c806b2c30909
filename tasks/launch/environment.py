"""What a job gets in its environment beside the spec's cluster.env: set by the drills and the tests, never a spec.

A job's environment has two sources, kept apart: `cluster.env` (the operator's, every launcher applies it) and a
`JobEnvironment`: the drill points of training/drill_points.py, which the production drills set on their own jobs,
and the folders and variables of a plugin the ranks import (the tests' harness, tests/faults/, puts its
`sitecustomize` there to patch the trainer). Launchers record it apart from `env` in the job's record.
"""

from __future__ import annotations

import os
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from training.drill_points import ENV_VAR as DRILL_POINTS_ENV
from training.drill_points import DrillPoints

PLUGIN_VARIABLE = re.compile(r"TDEPLOY_TEST_[A-Z0-9_]+")


class JobEnvironment(BaseModel):
    """The variables one job gets beside cluster.env (none by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    drill_points: DrillPoints = Field(
        default_factory=DrillPoints,
        description="Where the ranks stop for a drill (training/drill_points.py), as TDEPLOY_DRILL_POINTS.",
    )
    python_path: tuple[str, ...] = Field(
        default=(),
        description="Folders that make up the ranks' PYTHONPATH (a test harness first, whose sitecustomize "
        "patches the payload at start-up; then the folder training/ is imported from).",
    )
    plugin_env: dict[str, str] = Field(
        default_factory=dict,
        description="Settings of the modules on python_path, as TDEPLOY_TEST_* variables (tests/faults/: "
        "TDEPLOY_TEST_FAULTS); the job's own variables belong in cluster.env.",
    )

    @field_validator("plugin_env")
    @classmethod
    def _plugin_names(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(name for name in value if not PLUGIN_VARIABLE.fullmatch(name))
        if unknown:
            raise ValueError(
                f"plugin_env={unknown}: not plugin variables; name them TDEPLOY_TEST_* or put the job's own "
                "variables in cluster.env"
            )
        return value

    def variables(self) -> dict[str, str]:
        """The environment variables, to lay over the job's own (cluster.env and the workers' defaults)."""
        found: dict[str, str] = dict(self.plugin_env)
        if self.drill_points != DrillPoints():
            found[DRILL_POINTS_ENV] = self.drill_points.model_dump_json(exclude_none=True)
        if self.python_path:
            found["PYTHONPATH"] = os.pathsep.join(self.python_path)
        return found

    def with_drill_points(self, **fields: Any) -> JobEnvironment:
        """This environment with `fields` of DrillPoints set (for a drill's own job); the rest kept."""
        points = DrillPoints.model_validate({**self.drill_points.model_dump(exclude_none=True), **fields})
        return self.model_copy(update={"drill_points": points})
