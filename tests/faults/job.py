"""The job environment that applies test bugs to a job's ranks (see tests/faults/__init__.py)."""

from __future__ import annotations

from tasks.launch.environment import JobEnvironment
from tests.faults import HARNESS, ROOT
from tests.faults.bugs import ENV_VAR, TestFaults


def injected(base: JobEnvironment | None = None, **fields: object) -> JobEnvironment:
    """The job environment `base` (none: an empty one) with the bugs `fields` of TestFaults applied to the job."""
    faults = TestFaults.model_validate(fields)
    return (base or JobEnvironment()).model_copy(
        update={
            "python_path": (str(HARNESS), str(ROOT)),
            "plugin_env": {ENV_VAR: faults.model_dump_json(exclude_defaults=True)},
        }
    )
