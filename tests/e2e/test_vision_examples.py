"""The two vision examples end to end: `tdeploy run examples/vit.yaml` and `tdeploy run examples/vlm.yaml` go from
images to a served model with acceptance passed, each in its own folder with its images copied in (the examples'
paths are relative to the repository root, and tdeploy only reads under the folder it runs in).

The vit run: the image data step, training, acceptance (every dimension, rank_kill resuming bit-exactly with the
data order checked), the drills the example names (each recovered), the ViT export and the classifier served with its accuracy and macro F1 on the held-out
images in serving.json. The vlm run: the same from captioned images, the LLaVA export served by vLLM with greedy
parity on image prompts and BLEU/ROUGE of its captions in serving.json.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tasks.launch.torchrun import free_port
from tests.conftest import REPO
from tests.processes import run_group

pytestmark = pytest.mark.e2e


def _tdeploy_run(tmp_path: Path, example: str, images: str) -> Path:
    """`tdeploy run` of examples/<example>.yaml in tmp_path (its images copied there, a free port); the reports
    folder runs/<name>, after checking the run passed every step."""
    shutil.copytree(REPO / "examples" / "images" / images, tmp_path / "examples" / "images" / images)
    data = yaml.safe_load((REPO / "examples" / f"{example}.yaml").read_text())
    data["serve"]["port"] = free_port()
    spec = tmp_path / f"{example}.yaml"
    spec.write_text(yaml.safe_dump(data))
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "TDEPLOY_HOME": str(tmp_path / "tdeploy-home"),
    }
    env.pop("PREFECT_API_URL", None)
    tdeploy = shutil.which("tdeploy", path=str(Path(sys.executable).parent))
    proc = run_group([tdeploy, "run", str(spec)], timeout=1500, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"deploy-training {data['name']}: succeeded" in proc.stdout
    runs = tmp_path / "runs" / data["name"]
    summary = json.loads((runs / "summary.json").read_text())
    assert summary["failed_step"] is None, summary
    verdicts = {step["step"]: step["verdict"] for step in summary["steps"]}
    assert verdicts["data"] == verdicts["acceptance"] == verdicts["drills"] == verdicts["serving"] == "passed"
    drills = next(step["figures"] for step in summary["steps"] if step["step"] == "drills")
    assert all(drills[f"drill_{name}"] == "passed" for name in data["drills"]["only"]), drills
    root = Path(json.loads((runs / "acceptance" / "latest.json").read_text())["root"])
    acceptance = json.loads((root / "acceptance.json").read_text())
    assert acceptance["verdict"] == "passed", acceptance
    dimensions = {d["name"]: d for d in acceptance["dimensions"]}
    assert all(d["passed"] for d in dimensions.values()), dimensions
    assert {"correctness", "data_consistency", "recovery"} <= set(dimensions), dimensions
    assert dimensions["data_consistency"]["measured"]["epochs"], dimensions["data_consistency"]
    (kill,) = acceptance["drills"]
    assert kill["name"] == "rank_kill" and kill["passed"] and kill["state_matched"], kill
    return runs


@pytest.mark.timeout(1800)
def test_the_vit_example_goes_from_images_to_a_served_classifier_with_acceptance_passed(tmp_path: Path) -> None:
    runs = _tdeploy_run(tmp_path, "vit", "patterns")
    report = json.loads((runs / "serving" / "serving.json").read_text())
    assert report["kind"] == "classifier" and report["verdict"] == "passed", report["checks"]
    classification = report["classification"]
    # the whole validation split (10% of 4 x 100 images), well above chance (0.25)
    assert classification["images"] == 40 and classification["num_classes"] == 4, classification
    assert classification["accuracy"] >= 0.6 and classification["macro_f1"] >= 0.6, classification
    assert report["parity"]["top1_match"] == 1.0, report["parity"]
    assert report["load"]["failed"] == 0 and report["load"]["latency_ms"]["p99"] > 0, report["load"]
    config = json.loads((runs.parent.parent / report["model_dir"] / "config.json").read_text())
    assert config["architectures"] == ["ViTForImageClassification"], config


@pytest.mark.timeout(1800)
def test_the_vlm_example_goes_from_captioned_images_to_a_served_captioner_with_acceptance_passed(
    tmp_path: Path,
) -> None:
    runs = _tdeploy_run(tmp_path, "vlm", "captions")
    report = json.loads((runs / "serving" / "serving.json").read_text())
    assert report["verdict"] == "passed", report["checks"]
    parity = report["parity"]
    assert parity["prompts"] > 0 and parity["matched"] == parity["prompts"], parity
    quality = report["quality"]
    assert quality["prompts"] > 0 and 0 <= quality["rouge_l"] <= 1 and 0 <= quality["bleu4"] <= 100, quality
    assert report["load"]["failed"] == 0 and report["load"]["e2e_ms"]["p99"] > 0, report["load"]
    config = json.loads((runs.parent.parent / report["model_dir"] / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"], config
