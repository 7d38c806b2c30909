"""The serving check's judging: greedy parity, quality scores, thresholds, the load test's figures, its reports."""

from __future__ import annotations

import json
import math
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from tasks.serve.chain import ParityChain
from tasks.serve.check import ServingCheckConfig, ServingReport, check_problems
from tasks.serve.config import ServeConfig
from tasks.serve.load import bench_command, load_figures
from tasks.serve.report import write_junit
from training.config import ModelConfig
from validation.serving import (
    LogprobFigures,
    LatencyFigures,
    LoadFigures,
    ParityFigures,
    QualityFigures,
    ServerFigures,
    ServingThresholds,
    compare_greedy,
    judge,
    score_quality,
)

MODEL = ModelConfig(n_layers=2, d_model=64, n_heads=2, n_kv_heads=1, ffn_hidden=172, vocab_size=2048, seq_len=64)


def _load(p99_e2e: float = 40.0, failed: int = 0, tokens_per_s: float = 300.0) -> LoadFigures:
    lat = LatencyFigures(p50=p99_e2e / 2, p95=p99_e2e * 0.9, p99=p99_e2e, mean=p99_e2e / 2)
    return LoadFigures(
        requests=32,
        failed=failed,
        duration_s=2.0,
        output_tokens=512,
        output_tokens_per_s=tokens_per_s,
        requests_per_s=16.0,
        ttft_ms=lat,
        itl_ms=lat,
        e2e_ms=lat,
        max_concurrency=4,
        request_rate_per_s=None,
    )


def test_greedy_parity_counts_matching_prompts_and_names_the_first_differing_token() -> None:
    parity = compare_greedy([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]], [[1, 2, 3, 4, 0], [5, 6, 0, 8], [9]], tokens=4)
    assert (parity.prompts, parity.matched) == (3, 1)
    assert [(m["prompt"], m["position"]) for m in parity.first_mismatch] == [(1, 2), (2, 1)]
    assert parity.share == pytest.approx(1 / 3)


def test_quality_scores_identical_text_perfectly_and_unrelated_text_near_zero() -> None:
    refs = ["the quick brown fox jumps over the lazy dog", "a function returns the value of its argument"]
    same = score_quality(refs, refs)
    assert same.rouge_l == pytest.approx(1.0) and same.bleu4 == pytest.approx(100.0)
    other = score_quality(["zebra xylophone quantum", "purple monkey dishwasher"], refs)
    assert other.rouge_l < 0.1 and other.bleu4 < 5


@pytest.mark.parametrize(
    ("load", "matched", "failed_check"),
    [
        (_load(p99_e2e=400.0), 4, "p99_e2e_latency_ms"),
        (_load(failed=1), 4, "error_rate"),
        (_load(), 3, "greedy_match"),
    ],
)
def test_each_threshold_fails_the_check_with_its_name_and_fix(
    load: LoadFigures, matched: int, failed_check: str
) -> None:
    parity = ParityFigures(prompts=4, tokens=8, matched=matched)
    checks = judge(load, parity, QualityFigures(16, 0.3, 2.0), ServingThresholds(p99_e2e_latency_ms_max=150))
    failed = [c for c in checks if c.passed is False]
    assert [c.name for c in failed] == [failed_check]
    assert "must be" in failed[0].message and ";" in failed[0].message


def test_ungated_figures_are_reported_but_not_judged_and_unmeasured_gated_ones_fail() -> None:
    nan = LatencyFigures(math.nan, math.nan, math.nan, math.nan)
    load = LoadFigures(32, 0, 2.0, 512, 300.0, 16.0, nan, nan, nan, 4, None)
    checks = {c.name: c for c in judge(load, ParityFigures(4, 8, 4), QualityFigures(16, 0.3, 2.0), ServingThresholds())}
    assert checks["p99_ttft_ms"].passed is None and checks["output_tokens_per_s_per_device"].passed is None
    assert checks["p99_e2e_latency_ms"].passed is False and "not measured" in checks["p99_e2e_latency_ms"].message


def test_throughput_is_judged_per_serving_device() -> None:
    thresholds = ServingThresholds(output_tokens_per_s_min=200)
    parity, quality = ParityFigures(4, 8, 4), QualityFigures(16, 0.3, 2.0)
    one = {c.name: c for c in judge(_load(tokens_per_s=300), parity, quality, thresholds, devices=1)}
    two = {c.name: c for c in judge(_load(tokens_per_s=300), parity, quality, thresholds, devices=2)}
    assert one["output_tokens_per_s_per_device"].passed and two["output_tokens_per_s_per_device"].passed is False


def test_prompts_that_do_not_fit_the_served_context_are_refused_with_the_fix() -> None:
    assert check_problems(MODEL, ServeConfig(), ServingCheckConfig()) == []
    (problem,) = check_problems(MODEL, ServeConfig(max_model_len=40), ServingCheckConfig())
    assert "serve.check.prompt_tokens=32" in problem and "context of 40" in problem and "lower them" in problem


BENCH_RESULT = {
    "num_prompts": 32,
    "completed": 31,
    "failed": 1,
    "duration": 2.5,
    "total_output_tokens": 496,
    "output_throughput": 198.4,
    "request_throughput": 12.4,
    **{f"{p}_{m}_ms": v for m in ("ttft", "itl", "e2el") for p, v in (("p50", 10.0), ("p95", 20.0), ("p99", 30.0))},
    **{f"mean_{m}_ms": 12.0 for m in ("ttft", "itl", "e2el")},
    "ttfts": [0.01, 0.02],
    "itls": [[0.005, 0.005], [0.01]],
}


def test_the_load_figures_come_from_the_benchmark_result_file() -> None:
    load, per_request = load_figures(BENCH_RESULT, ServingCheckConfig())
    assert (load.requests, load.failed, load.output_tokens) == (32, 1, 496)
    assert load.error_rate == pytest.approx(1 / 32)
    assert (load.e2e_ms.p50, load.e2e_ms.p99, load.ttft_ms.p95) == (10.0, 30.0, 20.0)
    assert per_request == pytest.approx([20.0, 30.0])  # first token plus the gaps, in ms
    assert load_figures({**BENCH_RESULT, "latencies": [0.5, 0.25]}, ServingCheckConfig())[1] == [500.0, 250.0]


def test_the_benchmark_command_carries_the_checks_load_and_no_shell(tmp_path: Path) -> None:
    class _Server:
        url, served_name = "http://127.0.0.1:8123", "local"

    check = ServingCheckConfig(num_prompts=7, max_concurrency=3, request_rate_per_s=2.5, output_tokens=5)
    cmd = bench_command(Path("/py"), _Server(), tmp_path / "model", tmp_path / "p.jsonl", check, tmp_path)
    args = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert cmd[:2] == ["/py", "-c"] and "--save-detailed" in cmd and "--ignore-eos" in cmd
    assert args["--base-url"] == "http://127.0.0.1:8123" and args["--endpoint"] == "/v1/completions"
    assert cmd[cmd.index("--num-prompts") + 1] == "7" and cmd[cmd.index("--max-concurrency") + 1] == "3"
    assert cmd[cmd.index("--request-rate") + 1] == "2.5" and cmd[cmd.index("--custom-output-len") + 1] == "5"


def test_the_junit_file_has_one_case_per_judged_figure(tmp_path: Path) -> None:
    load = _load(p99_e2e=400.0)
    checks = judge(load, ParityFigures(4, 8, 4), QualityFigures(16, 0.3, 2.0), ServingThresholds())
    server = ServerFigures(3, 0.1, 4.0, 0.0, 3.5, 0.0)
    report = ServingReport(
        "m", 6, "http://x", 1, "cpu", 1, load, server, ParityFigures(4, 8, 4), LogprobFigures(4, 28, 1e-5, 1e-6),
        QualityFigures(16, 0.3, 2.0), checks, ParityChain([]), [1.0], {},
    )  # fmt: skip
    suite = ET.parse(write_junit(report, tmp_path / "junit.xml")).getroot()
    assert suite.get("tests") == str(len(checks)) and suite.get("failures") == "1"
    assert suite.get("skipped") == str(sum(1 for c in checks if c.passed is None))
    failure = suite.find("testcase[@name='p99_e2e_latency_ms']/failure")
    assert failure is not None and "400" in failure.get("message")
    assert not report.passed and report.failed == ["p99_e2e_latency_ms"]
    assert json.loads(json.dumps(report.to_json(), default=str))["verdict"] == "failed"


def test_the_sampler_counts_the_loads_engine_steps_from_counter_deltas_not_from_sampled_gauges() -> None:
    """A load shorter than the sampling interval leaves the gauges at 0; the iteration counter's growth between
    the scrape before the load and the one after still shows how many tokens the engine decoded per step."""
    import http.server
    import threading

    from tasks.serve.check import MetricsSampler

    state = {"count": 300.0, "sum": 900.0}

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = (
                "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
                "# TYPE vllm:iteration_tokens_total histogram\n"
                f'vllm:iteration_tokens_total_bucket{{le="+Inf"}} {state["count"]}\n'
                f"vllm:iteration_tokens_total_count {state['count']}\nvllm:iteration_tokens_total_sum {state['sum']}\n"
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        with MetricsSampler(f"http://127.0.0.1:{httpd.server_port}", interval_s=60) as sampler:
            state.update(count=300.0 + 128, sum=900.0 + 640)  # the load: 512 output tokens in 128 steps
        figures = sampler.figures(output_tokens=512)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert figures.running_max == 0.0 and figures.engine_steps == 128
    assert figures.output_tokens_per_step == 4.0 and figures.mean_batch_tokens == 5.0


def test_a_request_the_server_refuses_is_a_user_error_quoting_its_reason_not_a_retried_failure() -> None:
    import http.server
    import threading

    from tasks.errors import TransientError, UserError
    from tasks.serve.check import post_json

    reason = b'{"error": "This model\'s maximum context length is 64 tokens. However, you requested 65 tokens"}'

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(400 if self.path == "/bad" else 503)
            self.end_headers()
            self.wfile.write(reason)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(UserError) as refused:
            post_json(f"{url}/bad", {"prompt": [1, 2]})
        assert "HTTP 400" in str(refused.value) and "maximum context length is 64" in str(refused.value)
        assert not isinstance(refused.value, TransientError)
        with pytest.raises(TransientError, match="HTTP 503"):
            post_json(f"{url}/busy", {"prompt": [1, 2]})
    finally:
        server.shutdown()
        thread.join()
