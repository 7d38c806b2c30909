"""The cache of the pure steps (plan, image, data): a result is reused only where it was made and while whole.

Prefect keeps cached results in `PREFECT_HOME`, which outlives the run folder: a plain inputs-and-source key
hands a second folder (or the same one after `rm -rf runs`) a result that points at files that are not there.
So the key also holds the folder that relative locations resolve against, and a hit is checked first: the
cached result's `artifact_problem` (its plan.json, image.json and image, or dataset) must find nothing wrong,
else the cached record is expired and the step runs again, writing its result under the same key.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy
from prefect.context import TaskRunContext
from prefect.utilities.hashing import hash_objects

log = logging.getLogger(__name__)

CACHE_DAYS = 7


@dataclass
class WholeArtifacts(CachePolicy):
    """Inputs and task source, plus where relative locations resolve; a hit whose artifacts are gone is void."""

    base: CachePolicy = field(default_factory=lambda: INPUTS + TASK_SOURCE)

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        """The key; a stored record under it whose result's artifacts are missing or broken is expired first."""
        base = self.base.compute_key(task_ctx, inputs, flow_parameters, **kwargs)
        if base is None:
            return None
        # Every relative location in the inputs (runs/<name>/...) resolves against the working folder.
        key = hash_objects(base, os.path.realpath(os.getcwd()))
        if key is None:
            return None
        store = task_ctx.result_store
        if store.exists(key):
            result = store.read(key).result
            problem = artifact_problem(result, inputs)
            if problem is not None:
                log.warning("%s: the cached result is void (%s); running the step again", task_ctx.task.name, problem)
                store.write(obj=result, key=key, expiration=datetime.now(UTC) - timedelta(seconds=1))
        return key


def artifact_problem(result: Any, inputs: dict[str, Any]) -> str | None:
    """What is wrong with the files a cached step result points at (None: whole, or it points at none).

    `inputs` are the task's call arguments: a step task takes its typed Inputs as `inputs` (tasks/<step>/step.py),
    which the result's check looks with (the storage, the registry)."""
    check = getattr(result, "artifact_problem", None)
    if check is None:
        return None
    try:
        return check(inputs.get("inputs"))
    except Exception as err:  # a check that cannot even look (storage gone) voids the hit: the step says why
        return f"its artifacts could not be checked ({type(err).__name__}: {err})"


def cached_step_options() -> dict[str, Any]:
    """`with_options` for a cached step: the policy above, results persisted, kept CACHE_DAYS days."""
    return {"cache_policy": WholeArtifacts(), "persist_result": True, "cache_expiration": timedelta(days=CACHE_DAYS)}
