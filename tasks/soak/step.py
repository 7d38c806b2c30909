"""The soak step: its inputs from the spec, its plain `run` (what `tdeploy soak` and the nightly flow's task call),
its result's files and the constants its task uses."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from tasks.paths import workspace_base
from tasks.errors import UserError
from tasks.launch.cluster import ClusterConfig
from tasks.launch.environment import JobEnvironment
from tasks.run_id import new_run_id
from tasks.soak.config import SoakConfig
from tasks.soak.report import write_report
from tasks.soak.result import SoakResult
from tasks.soak.run import run_soak
from training.config import TrainConfig

if TYPE_CHECKING:
    from tasks.spec import DeploymentSpec

log = logging.getLogger(__name__)

TITLE = "soak under injected failures"
ARTIFACT = "soak"
SOAK_DIR = "soak"


class SoakFailed(UserError):
    """A failure was not recovered by its expected rung, a process leaked, or a loss was not finite."""


class SoakInputs(BaseModel):
    """The soak step: where its job runs, the job it soaks, the soak's settings and its folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    cluster: ClusterConfig
    train: TrainConfig
    soak: SoakConfig
    root: str
    """The soak's folder: its job's output and checkpoints, soak.json and soak.md."""
    image: str | None = None
    environment: JobEnvironment | None = None
    """Variables the soak's job gets beside cluster.env: the tests', never a spec's."""

    @classmethod
    def of(
        cls,
        spec: DeploymentSpec,
        train: TrainConfig,
        soak: SoakConfig,
        *,
        image: str | None = None,
        work_url: str | None = None,
        nightly: bool = False,
        environment: JobEnvironment | None = None,
    ) -> SoakInputs:
        """The soak `soak` of `train` by `spec`, in a new folder under `work_url` (default: acceptance.work_url's,
        beside the acceptance runs) <base>/soak/<run-id>."""
        base = Path(work_url) if work_url else workspace_base(spec.acceptance.work_url, train.run.output_url, nightly)
        root = base / SOAK_DIR / new_run_id()
        return cls(cluster=spec.cluster, train=train, soak=soak, root=str(root), image=image, environment=environment)


def run(inputs: SoakInputs, publish: Callable[[SoakResult], None] | None = None) -> SoakResult:
    """Run the soak in its folder, write soak.json and soak.md, hand the result to `publish`; SoakFailed (after
    writing the files) when it did not pass."""
    root = Path(inputs.root)
    root.mkdir(parents=True, exist_ok=True)
    log.info("soak folder %s", root)
    result = run_soak(inputs.cluster, inputs.train, inputs.soak, root, inputs.environment, inputs.image)
    result = write_report(result, root)
    if publish is not None:
        publish(result)
    if not result.passed:
        raise SoakFailed(f"soak failed: {'; '.join(result.problems)}", f"see {result.files['markdown']}")
    return result
