"""Every model kind's serving check writes the same files through the one writer (serving.json, junit.xml, the
latency histogram, the serving manifests of its server), and the serving step, `tdeploy check-serving` and the
pipeline's task dispatch on model.kind in one place (tasks/serve/step.py `run_check`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from xml.etree import ElementTree as ET

import pytest
import yaml

from tasks.serve import step
from tasks.serve.captioning import CaptioningReport, CaptioningServingResult
from tasks.serve.chain import ParityChain
from tasks.serve.check import ServingReport
from tasks.serve.classifier import ClassifierReport, ClassifierServerFigures, ClassifierServingResult
from tasks.serve.config import ServeConfig
from tasks.serve.report import write_reports
from tasks.serve.step import ServingCheckFailed, ServingInputs, ServingResult
from validation.classifier_serving import (
    ClassificationFigures, ClassifierParityFigures, ClassifierThresholds, ImageLoadFigures, judge_classifier,
)  # fmt: skip
from validation.serving import (
    hop, LatencyFigures, LoadFigures, LogprobFigures, ParityFigures, QualityFigures, ServerFigures, ServingThresholds,
    judge,
)  # fmt: skip

LATENCY = LatencyFigures(p50=20.0, p95=36.0, p99=40.0, mean=21.0)
PER_REQUEST_MS = [12.0, 20.0, 22.0, 40.0]


def _lm(model_dir: str, p99_max: float = 150.0) -> ServingReport:
    load = LoadFigures(4, 0, 2.0, 64, 32.0, 2.0, LATENCY, LATENCY, LATENCY, 2, None)
    parity, quality = ParityFigures(4, 8, 4), QualityFigures(4, 0.4, 20.0)
    checks = judge(load, parity, quality, ServingThresholds(p99_e2e_latency_ms_max=p99_max))
    return ServingReport(model_dir, 6, "http://x", 1, "cpu", 1, load, ServerFigures(3, 0.1, 4.0, 0.0, 3.5, 0.0),
                         parity, LogprobFigures(4, 28, 1e-5, 1e-6), quality, checks,
                         ParityChain([hop("served", "vLLM vs ours", "greedy match", 1.0, 1.0, False, "s")]),
                         PER_REQUEST_MS, {})  # fmt: skip


def _vlm(model_dir: str, p99_max: float = 150.0) -> CaptioningReport:
    nan = LatencyFigures(float("nan"), float("nan"), float("nan"), float("nan"))
    load = LoadFigures(4, 0, 2.0, 24, 12.0, 2.0, nan, nan, LATENCY, 2, None)
    parity, quality = ParityFigures(4, 6, 4), QualityFigures(4, 0.3, 10.0)
    checks = judge(load, parity, quality, ServingThresholds(p99_e2e_latency_ms_max=p99_max))
    return CaptioningReport(model_dir, 6, "http://x", 1, "cpu", "transformers", load, 2.0, parity, quality, checks,
                            ["a cat"], ["a cat"], {"server_log": "server.log"}, PER_REQUEST_MS)  # fmt: skip


def _vit(model_dir: str, p99_max: float = 150.0) -> ClassifierReport:
    load = ImageLoadFigures(4, 0, 4, 1.0, 4.0, 4.0, LATENCY, 2, 1)
    quality = ClassificationFigures(4, 1.0, 1.0, 2, "val")
    parity = ClassifierParityFigures(4, 4, 1e-7, 1e-8)
    checks = judge_classifier(load, quality, parity, ClassifierThresholds(p99_latency_ms_max=p99_max))
    return ClassifierReport(model_dir, 6, "http://x", 1, "cpu", load, ClassifierServerFigures(3, 1.0, 0.0, 2.0, 2.0),
                            quality, parity, checks, PER_REQUEST_MS)  # fmt: skip


REPORTS = {"lm": _lm, "vlm": _vlm, "vit": _vit}


def _checked(kind: str, p99_max: float = 150.0) -> ServingReport | CaptioningReport | ClassifierReport:
    """A report as a check returns it: its files written."""
    report = REPORTS[kind]("/m", p99_max)
    return type(report)(**{**report.__dict__, "files": {"json": "/r/serving.json"}})


@pytest.mark.parametrize("kind", list(REPORTS))
def test_every_kinds_serving_check_writes_the_same_files_through_one_writer(tmp_path: Path, kind: str) -> None:
    report = REPORTS[kind](str(tmp_path / "export" / "step-6"))
    written = write_reports(report, ServeConfig(dtype="float32"), "demo", tmp_path)
    names = {"junit", "histogram", "serving-k8s.yaml", "serving.sbatch", "json"}
    assert names <= set(written.files) and all(Path(written.files[n]).is_file() for n in names)
    cases = ET.parse(written.files["junit"]).getroot().findall("testcase")
    assert [c.get("name") for c in cases] == [c.name for c in report.checks]
    assert Path(written.files["histogram"]).stat().st_size > 0
    data = json.loads(Path(written.files["json"]).read_text())
    assert data["files"] == written.files and "per_request_ms" not in data and "per_request_e2e_ms" not in data
    objects = list(yaml.safe_load_all(Path(written.files["serving-k8s.yaml"]).read_text()))
    container = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    script = Path(written.files["serving.sbatch"]).read_text()
    if kind == "vit":
        assert container["command"] == ["python3", "/opt/tdeploy/classifier_server.py"]
        assert "exec python3 - --model " in script
    else:
        assert container["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        assert ("--limit-mm-per-prompt" in container["args"]) == (kind == "vlm") == ("--limit-mm-per-prompt" in script)
    assert f"--model {tmp_path / 'export' / 'step-6'}" in script  # the folder the check served


@pytest.mark.parametrize("kind", list(REPORTS))
def test_the_histogram_draws_each_kinds_p99_threshold(kind: str) -> None:
    plot = REPORTS[kind]("/m", p99_max=123.0).latency_plot()
    assert plot.per_request_ms == PER_REQUEST_MS and plot.figures == LATENCY and plot.threshold_ms == 123.0


def _inputs(kind: str, tmp_path: Path) -> ServingInputs:
    return ServingInputs.model_construct(
        serve=ServeConfig(), train=SimpleNamespace(model=SimpleNamespace(kind=kind)), accelerator="cpu", name="demo",
        out_dir=str(tmp_path), export_root=str(tmp_path / "export"), step=None, model_dir=None,
        quantization_json=None, acceptance=None, pod_memory_bytes=2.0**30,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "check", "result"),
    [("lm", "run_serving_check", ServingResult), ("vit", "run_classifier_check", ClassifierServingResult),
     ("vlm", "run_captioning_check", CaptioningServingResult)],
)  # fmt: skip
def test_the_serving_step_runs_the_check_of_the_models_kind_and_publishes_its_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str, check: str, result: type
) -> None:
    called = []
    for name, of in (("run_serving_check", "lm"), ("run_classifier_check", "vit"), ("run_captioning_check", "vlm")):
        monkeypatch.setattr(step, name, lambda *args, _of=of: called.append((_of, args)) or _checked(_of))
    published = []
    got = step.run(_inputs(kind, tmp_path), published.append)
    assert [c[0] for c in called] == [kind] and isinstance(got, result) and len(published) == 1
    assert 2.0**30 in called[0][1]  # the serving plan's pod memory reaches every kind's manifests
    monkeypatch.setattr(step, check, lambda *args: _checked(kind, p99_max=1.0))
    with pytest.raises(ServingCheckFailed, match="p99"):
        step.run(_inputs(kind, tmp_path))


@pytest.mark.parametrize("kind", list(REPORTS))
def test_check_serving_prints_any_kinds_table_and_summary(kind: str, capsys: pytest.CaptureFixture) -> None:
    from flows.cli.serve import _print_serving

    report = _checked(kind)
    _print_serving(report)
    out = capsys.readouterr().out
    assert step.result_of(report).summary().split(";")[0] in out and "report /r/serving.json" in out
    assert ("parity served, greedy match: 1 >= 1 pass" in out) == (kind == "lm")  # a language model's chain
