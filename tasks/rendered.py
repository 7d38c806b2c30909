"""Every file a deployment generates, rendered without touching a cluster (`tdeploy render`).

The files come from the functions the steps themselves use (the launcher's job script or manifests, the image
step's Containerfile, the node checks' inventory and extravars, the serving step's manifests), each checked as
the step checks it before use, and shell scripts also by shellcheck where it is installed. What a step only knows
once earlier steps ran (the prepared dataset's key, the built image's digest) is a placeholder that says so.
Secrets never appear: the spec holds none (it refuses credentials), and the Ansible data is redacted anyway.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from tasks.capacity.step import serving_pod_memory
from tasks.errors import UserError
from tasks.image.build import prepare_inputs
from tasks.image.registry import RegistryClient
from tasks.launch.base import RenderedFile
from tasks.launch.registry import capabilities, launcher_class
from tasks.nodes.inventory import plan_checks
from tasks.paths import DeploymentPaths
from tasks.serve.manifests import K8S_FILE, SLURM_FILE, PodResources, serving_manifests
from tasks.spec import DeploymentSpec
from training.config import TrainConfig
from training.secrets import redact

INDEX_FILE = "RENDERED.md"
PREPARED_DATASET = "<key-of-the-prepared-dataset>"
"""The last part of run.json's dataset_url when data.prepare is set: the data step names the dataset by a hash of
its inputs, known once it has read them."""
SHELLCHECK_TIMEOUT_S = 60


@dataclass(frozen=True)
class Rendering:
    """The files of one spec and the notes on what they leave to the steps."""

    files: list[RenderedFile]
    notes: list[str]


def _training_config(spec: DeploymentSpec) -> tuple[TrainConfig, list[str]]:
    """The job's training config (run.json) and what in it the data step decides."""
    if spec.data.prepare is None:
        return spec.training_config(), []
    url = f"{spec.data.prepare.output_url.rstrip('/')}/{PREPARED_DATASET}"
    note = f"run.json's data.dataset_url ends in {PREPARED_DATASET}: the data step names the dataset it prepares"
    return spec.training_config(url), [note]


def _image(spec: DeploymentSpec) -> tuple[list[RenderedFile], str | None, list[str]]:
    """The Containerfile and requirements.txt of the image step, and the reference the job would run."""
    if spec.image is None:
        return [], None, ["image: null: the job runs in the nodes' own environment (no Containerfile)"]
    inputs = prepare_inputs(spec.image, with_s3=spec.uses_s3())
    files = [
        RenderedFile("image/Containerfile", inputs.containerfile, "the training image's Containerfile",
                     f"rendered by the image step (content tag {inputs.tag})"),
        RenderedFile("image/requirements.txt", "".join(f"{r}\n" for r in inputs.requirements),
                     "the image's pinned requirements", "pinned from this environment"),
    ]  # fmt: skip
    if spec.image.registry_url is None:
        return files, f"{spec.image.repository}:{inputs.tag}", []
    return files, RegistryClient(spec.image.registry_url, spec.image.registry_insecure).reference(
        spec.image.repository, inputs.tag
    ), []


def _nodes(spec: DeploymentSpec) -> tuple[list[RenderedFile], list[str]]:
    """The node checks' Ansible inventory and extravars, as the playbook run gets them (redacted); where the node
    checks could not be planned on this machine (no hosts listed, a key file that lives elsewhere), a note why."""
    try:
        plan = plan_checks(spec.nodes, spec.cluster)
    except UserError as err:
        return [], [f"no Ansible inventory: {err}"]
    return [
        RenderedFile("ansible/inventory.yml", yaml.safe_dump(redact(plan.inventory), sort_keys=False),
                     "the node checks' Ansible inventory", "built by the node-check step (values passed as unsafe)"),
        RenderedFile("ansible/extravars.yml", yaml.safe_dump(redact(plan.extravars), sort_keys=False),
                     "the node-check roles' variables", "checked by the roles' argument specs when they run"),
    ], []  # fmt: skip


def _serving(spec: DeploymentSpec) -> list[RenderedFile]:
    """The serving step's Kubernetes manifests and Slurm script for the exported model, as it writes them."""
    if spec.serve is None:
        return []
    resources = PodResources.of(spec.serve, serving_pod_memory(spec))
    files = serving_manifests(spec.serve, spec.name, DeploymentPaths.of(spec).export_dir, None,
                              spec.cluster.accelerator, resources, spec.model.kind)  # fmt: skip
    server, objects = ("the classifier server", "ConfigMap (its program), Deployment and Service") \
        if spec.model.kind == "vit" else ("vLLM's server", "Deployment and Service")  # fmt: skip
    return [
        RenderedFile(f"serving/{K8S_FILE}", files[K8S_FILE],
                     f"{server} as a Kubernetes {objects}", "the Kubernetes API's models"),
        RenderedFile(f"serving/{SLURM_FILE}", files[SLURM_FILE],
                     f"{server} as a Slurm job", "every value quoted for the shell", shell=True),
    ]  # fmt: skip


def render_all(spec: DeploymentSpec) -> Rendering:
    """Every file the deployment of `spec` would generate, each checked; UserError naming the first that fails."""
    train, notes = _training_config(spec)
    image_files, image, image_notes = _image(spec)
    run_json = train.model_dump_json(indent=2)
    TrainConfig.model_validate_json(run_json)  # what every rank does first
    files = [RenderedFile("run.json", run_json, "the training config every rank reads",
                          "read back by training.config.TrainConfig as the job does")]  # fmt: skip
    files += launcher_class(spec.cluster.scheduler).rendered_files(spec.cluster, train, spec.name, image)
    node_files, node_notes = _nodes(spec)
    files += image_files + node_files + _serving(spec)
    notes += image_notes + node_notes
    if image is not None and capabilities(spec.cluster.scheduler).runs_image:
        notes.append(f"the job runs {image}: the tag is the hash of the Containerfile, the payload and the "
                     "requirements, as the image step computes it")  # fmt: skip
    checked = [_shellchecked(f) if f.shell else f for f in files]
    return Rendering(files=checked, notes=notes)


def _shellchecked(file: RenderedFile) -> RenderedFile:
    """`file` with shellcheck's verdict; UserError listing its findings when it has any."""
    tool = shutil.which("shellcheck")
    if tool is None:
        return RenderedFile(file.name, file.text, file.what, f"{file.checked}; shellcheck not installed: not run",
                            shell=True)  # fmt: skip
    proc = subprocess.run([tool, "--shell=bash", "--format=gcc", "-"], input=file.text, capture_output=True,
                          text=True, timeout=SHELLCHECK_TIMEOUT_S)  # fmt: skip
    if proc.returncode != 0:
        findings = (proc.stdout or proc.stderr).replace("-:", f"{file.name}:").strip()
        raise UserError(f"{file.name} is not shellcheck-clean:\n{findings}", "this is a rendering bug; report it")
    return RenderedFile(file.name, file.text, file.what, f"{file.checked}; shellcheck clean", shell=True)


def write_rendering(rendering: Rendering, out: Path) -> list[Path]:
    """Write the files under `out` (made fresh: a folder holding anything but an earlier rendering is refused) with
    RENDERED.md listing each, what checked it and the notes; the files land under their names only at the end."""
    if out.exists() and any(out.iterdir()) and not (out / INDEX_FILE).is_file():
        raise UserError(f"--out {out}: the folder exists and holds other files", "give an empty or new folder")
    staging = out.with_name(f".{out.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    written = []
    for file in rendering.files:
        path = staging / file.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(file.text)
        if file.shell:
            path.chmod(0o755)
        written.append(out / file.name)
    (staging / INDEX_FILE).write_text(index_markdown(rendering))
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return written


def index_markdown(rendering: Rendering) -> str:
    """RENDERED.md: one row per file (what it is, what checked it) and the notes."""
    lines = ["# Files this deployment generates", "", "| file | what | checked |", "|---|---|---|"]
    lines += [f"| `{f.name}` | {f.what} | {f.checked} |" for f in rendering.files]
    if rendering.notes:
        lines += ["", "Notes:", "", *(f"- {note}" for note in rendering.notes)]
    return "\n".join(lines) + "\n"
