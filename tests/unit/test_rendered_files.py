"""`tdeploy render`: every example spec renders every file its deployment generates, each passing the validator
its step applies (shellcheck for scripts, the API schemas for manifests, TrainConfig for run.json), into a folder
that never holds a half-written rendering."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.errors import UserError
from tasks.launch.base import RenderedFile
from tasks.launch.kubernetes import validate_manifests
from tasks.rendered import INDEX_FILE, Rendering, _shellchecked, render_all, write_rendering
from tasks.serve.manifests import SERVER_MODULE, validate_kubernetes
from tasks.spec import load_spec
from tests.conftest import REPO
from training.config import TrainConfig

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _from_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # examples name the repository's own files (examples/models/...) relative to it


def test_shellcheck_is_installed_for_these_tests() -> None:
    assert shutil.which("shellcheck"), "install shellcheck (.ci/apt/test/render.txt)"


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_renders_and_every_file_passes_its_validator(example: Path) -> None:
    spec = load_spec(example)
    rendering = render_all(spec)
    names = [f.name for f in rendering.files]
    assert "run.json" in names
    TrainConfig.model_validate_json(next(f.text for f in rendering.files if f.name == "run.json"))
    if spec.cluster.scheduler == "slurm":
        assert "slurm/job.sbatch" in names
    if spec.image is not None:
        assert "image/Containerfile" in names
    if spec.cluster.scheduler == "kubernetes":
        manifests = list(yaml.safe_load_all(next(f.text for f in rendering.files if f.name == "kubernetes/job.yaml")))
        assert {m["kind"] for m in manifests} >= {"ConfigMap", "TrainJob"}
        validate_manifests(manifests)
    if spec.serve is not None:
        assert {"serving/serving-k8s.yaml", "serving/serving.sbatch"} <= set(names)
        serving = list(yaml.safe_load_all(next(f.text for f in rendering.files if f.name.endswith("k8s.yaml"))))
        validate_kubernetes(serving)
        deployment = next(o for o in serving if o["kind"] == "Deployment")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        # the server the serving check starts for the model's kind, with a vision-language model's image limit
        vit = spec.model.kind == "vit"
        assert container["command"][-1] == ("/opt/tdeploy/classifier_server.py" if vit else SERVER_MODULE)
        assert ("--limit-mm-per-prompt" in container["args"]) == (spec.model.kind == "vlm")
        assert container["resources"]["requests"] == container["resources"]["limits"]  # Guaranteed, from the plan
        assert "memory" in container["resources"]["requests"]
        if spec.cluster.accelerator == "cpu":
            assert "vllm-cpu" in container["image"]
    for file in rendering.files:
        if file.shell:
            assert file.checked.endswith("shellcheck clean"), file
        if file.name.endswith((".yaml", ".yml")):
            assert list(yaml.safe_load_all(file.text)), file.name


def test_a_script_with_a_shellcheck_finding_is_refused_naming_the_file() -> None:
    script = RenderedFile("slurm/job.sbatch", "#!/bin/bash\nfor f in $(ls $HOME); do echo $f; done\n", "a script",
                          "quoted", shell=True)  # fmt: skip
    with pytest.raises(UserError, match=r"slurm/job.sbatch is not shellcheck-clean"):
        _shellchecked(script)


def test_the_sbatch_script_of_a_hostile_value_is_still_shellcheck_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TDEPLOY_ALLOWED_ENV", "NOTE")
    data = yaml.safe_load((REPO / "examples" / "slurm.yaml").read_text())
    data["cluster"]["env"] = {"NOTE": "a $(rm -rf /) `x` 'q' \"d\" ; & | value"}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    script = next(f for f in render_all(load_spec(path)).files if f.name == "slurm/job.sbatch")
    assert script.checked.endswith("shellcheck clean")
    assert "export NOTE='a $(rm -rf /) `x` '\"'\"'q'\"'\"' \"d\" ; & | value'" in script.text


def test_a_folder_with_other_files_is_refused_and_a_rendering_replaces_the_last(tmp_path: Path) -> None:
    rendering = Rendering(files=[RenderedFile("a/one.txt", "1\n", "one", "none")], notes=["a note"])
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="holds other files"):
        write_rendering(rendering, foreign)
    assert (foreign / "keep.txt").read_text() == "mine"
    out = tmp_path / "out"
    write_rendering(rendering, out)
    write_rendering(Rendering(files=[RenderedFile("b.txt", "2\n", "two", "none")], notes=[]), out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == ["RENDERED.md", "b.txt"]
    assert not list(tmp_path.glob(".*partial"))


def test_tdeploy_render_writes_the_files_and_their_index(tmp_path: Path) -> None:
    out = tmp_path / "rendered"
    result = CliRunner().invoke(app, ["render", str(REPO / "examples" / "slurm.yaml"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "slurm" / "job.sbatch").read_text().startswith("#!/bin/bash\n")
    index = (out / INDEX_FILE).read_text()
    assert "| `slurm/job.sbatch` |" in index and "shellcheck clean" in index
