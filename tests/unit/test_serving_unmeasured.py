"""A load test in which no request completed measured no latency: its latency figures are NaN, not vLLM's 0 ms,
and the gates fail saying so (a killed server once passed p99_e2e_latency_ms=0 from 32 failed requests)."""

from __future__ import annotations

import math

from tasks.serve.check import ServingCheckConfig
from tasks.serve.load import load_figures
from validation.serving import ParityFigures, QualityFigures, ServingThresholds, judge

# What `vllm bench serve` writes when every request failed (its percentiles of an empty list are 0).
ALL_FAILED = {
    "num_prompts": 32,
    "completed": 0,
    "failed": 32,
    "duration": 0.4,
    "total_output_tokens": 0,
    "output_throughput": 0.0,
    "request_throughput": 0.0,
    **{f"{p}_{m}_ms": 0.0 for m in ("ttft", "itl", "e2el", "tpot") for p in ("mean", "median", "p50", "p95", "p99")},
    "ttfts": [0.0] * 32,
    "itls": [[] for _ in range(32)],
    "latencies": [0.0] * 32,
}


def test_latencies_of_a_load_where_no_request_completed_are_not_measured_and_fail_their_gates() -> None:
    load, per_request = load_figures(ALL_FAILED, ServingCheckConfig())
    assert (load.requests, load.failed, load.completed) == (32, 32, 0)
    assert all(math.isnan(x) for lat in (load.e2e_ms, load.ttft_ms, load.itl_ms) for x in vars(lat).values())
    assert per_request == []

    thresholds = ServingThresholds(p99_e2e_latency_ms_max=150.0, p99_ttft_ms_max=100.0, error_rate_max=0.5)
    checks = {c.name: c for c in judge(load, ParityFigures(4, 8, 4), QualityFigures(4, 1.0, 100.0), thresholds)}
    for name in ("p99_e2e_latency_ms", "p99_ttft_ms"):
        assert checks[name].passed is False, checks[name]
        assert checks[name].message.startswith(f"{name} was not measured; none of the load test's 32 requests "
                                               "completed, so no latency was measured")  # fmt: skip
    assert checks["error_rate"].passed is False and checks["error_rate"].measured == 1.0
