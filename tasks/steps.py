"""The deployment's steps, in order: what the flows walk and what the summary page, the progress line and the
diagnosis read. Each step's title, artifact key and result type are its package's (tasks/<step>/step.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.acceptance import step as acceptance
from tasks.capacity import step as capacity
from tasks.image import step as image
from tasks.launch import step as job
from tasks.nodes import step as nodes
from tasks.prepare import step as data
from tasks.quantize import step as quantize
from tasks.results import SkippedResult, StepResult
from tasks.serve import step as serving
from tasks.soak import step as soak
from tasks.soak.result import SoakResult

DIAGNOSIS_ARTIFACT = "diagnosis"
"""Where the diagnosis of a failed step is published (the details of a failed spec, which has no artifact)."""


@dataclass(frozen=True)
class Step:
    """One step of a flow: its name (the key of its result), its title on the summary page, the key of the
    artifact with its details, and the type of its result (None: the spec's validation, which has none)."""

    name: str
    title: str
    artifact: str
    result: tuple[type[StepResult], ...] = ()


SPEC = Step("spec", "spec validation", DIAGNOSIS_ARTIFACT)
CAPACITY = Step("capacity", capacity.TITLE, capacity.ARTIFACT, (capacity.CapacityResult,))
NODES = Step("nodes", nodes.TITLE, nodes.ARTIFACT, (nodes.NodesResult,))
IMAGE = Step("image", image.TITLE, image.ARTIFACT, (image.ImageStepResult,))
DATA = Step("data", data.TITLE, data.ARTIFACT, (data.DataResult,))
JOB = Step("job", job.TITLE, job.ARTIFACT, (job.JobResult,))
ACCEPTANCE = Step("acceptance", acceptance.TITLE, acceptance.ARTIFACT, (acceptance.AcceptanceResult,))
DRILLS = Step("drills", acceptance.DRILLS_TITLE, acceptance.DRILLS_ARTIFACT, (acceptance.AcceptanceResult,))
SOAK = Step("soak", soak.TITLE, soak.ARTIFACT, (SoakResult, SkippedResult))
QUANTIZE = Step("quantize", quantize.TITLE, quantize.ARTIFACT, (quantize.QuantizeResult, SkippedResult))
SERVING = Step("serving", serving.TITLE, serving.ARTIFACT, (serving.ServingResult, SkippedResult))

DEPLOY: tuple[Step, ...] = (SPEC, CAPACITY, NODES, IMAGE, DATA, JOB, ACCEPTANCE, DRILLS, QUANTIZE, SERVING)
"""deploy-training: every step, in the order the flow runs them (and the summary page lists them)."""
NIGHTLY: tuple[Step, ...] = (SPEC, DATA, ACCEPTANCE, DRILLS, SOAK)
"""nightly-validation: the data (reused), a soak-length acceptance, every drill and the soak under injected
failures (the spec's soak section; skipped without one)."""

BY_NAME = {step.name: step for step in DEPLOY}
