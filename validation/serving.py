"""Serving acceptance as plain functions: latency, throughput, errors, greedy parity and generation quality.

The measurements come from the load generator (vLLM's `bench serve`), the server's own Prometheus metrics and
completions requested from the server; this module only judges them against `ServingThresholds`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from training.config import StrictModel


class ServingThresholds(StrictModel):
    """Pass thresholds of the serving check (`serve.check.thresholds`)."""

    p99_e2e_latency_ms_max: float = Field(
        default=150.0,
        gt=0,
        description="Largest P99 end-to-end latency of a short completion (serve.check.output_tokens tokens), "
        "in ms. The guide's GPU target is 150 ms; a CPU deployment sets a looser value that still fails on a "
        "collapse.",
    )
    p99_ttft_ms_max: float | None = Field(
        default=None, gt=0, description="Largest P99 time to first token in ms; None = not gated."
    )
    error_rate_max: float = Field(
        default=0.0, ge=0, le=1, description="Largest share of load-test requests that failed (0 = none may fail)."
    )
    output_tokens_per_s_min: float | None = Field(
        default=None,
        gt=0,
        description="Smallest output tokens/s of the load test per serving device (per GPU on GPUs, per server "
        "on CPU); None = not gated.",
    )
    greedy_match_min: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Smallest share of parity prompts whose served greedy completion equals our own model's "
        "for the first serve.check.parity_tokens tokens.",
    )
    rouge_l_min: float = Field(
        default=0.0, ge=0, le=1, description="Smallest ROUGE-L F1 (0-1) of greedy continuations of held-out text."
    )
    bleu4_min: float = Field(
        default=0.0, ge=0, le=100, description="Smallest corpus BLEU-4 (sacrebleu, 0-100) of the same continuations."
    )


@dataclass(frozen=True)
class LatencyFigures:
    """Percentiles in ms of one latency measure over the load test's requests."""

    p50: float
    p95: float
    p99: float
    mean: float


@dataclass(frozen=True)
class LoadFigures:
    """What the load test measured."""

    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms: LatencyFigures
    itl_ms: LatencyFigures
    e2e_ms: LatencyFigures
    max_concurrency: int | None
    request_rate_per_s: float | None

    @property
    def error_rate(self) -> float:
        """Failed requests over all sent."""
        return self.failed / self.requests if self.requests else 1.0

    @property
    def completed(self) -> int:
        """Requests that completed (the latencies are theirs)."""
        return self.requests - self.failed


@dataclass(frozen=True)
class ServerFigures:
    """The server's own metrics sampled while the load test ran (maximum over the samples)."""

    samples: int
    kv_cache_usage_max: float | None
    running_max: float | None
    waiting_max: float | None
    mean_batch_tokens: float | None
    """Mean tokens per engine step (vLLM's iteration_tokens histogram): the batch the engine really ran."""
    preemptions: float | None
    engine_steps: float | None = None
    """Engine steps the load test took (the iteration_tokens histogram's count, after minus before): the
    gauges above are sampled and can miss a short load, this counter cannot."""
    output_tokens_per_step: float | None = None
    """The load's output tokens over its engine steps: above 1 only when the engine decoded several requests
    in one step (continuous batching); a server running one request at a time needs a step per token."""


@dataclass(frozen=True)
class ParityFigures:
    """Greedy completions of the server against our own model's, prompt by prompt."""

    prompts: int
    tokens: int
    matched: int
    first_mismatch: list[dict[str, Any]] = field(default_factory=list)
    """Per mismatching prompt: its index, the position of the first differing token, ours and the server's."""

    @property
    def share(self) -> float:
        """Matching prompts over all."""
        return self.matched / self.prompts if self.prompts else 0.0


@dataclass(frozen=True)
class LogprobFigures:
    """The server's log-probabilities of the parity prompts' own tokens against our model's, token by token: how
    far what is served is from the training forward (greedy parity only sees a flip of the argmax)."""

    prompts: int
    tokens: int
    max_abs_diff: float
    mean_abs_diff: float


def logprob_deviation(ours: list[list[float]], served: list[list[float]]) -> LogprobFigures:
    """|served - ours| over every scored token of every prompt (equal lengths per prompt)."""
    diffs = [abs(a - b) for o, s in zip(ours, served, strict=True) for a, b in zip(o, s, strict=True)]
    return LogprobFigures(prompts=len(ours), tokens=len(diffs), max_abs_diff=max(diffs, default=0.0),
                          mean_abs_diff=sum(diffs) / len(diffs) if diffs else 0.0)  # fmt: skip


@dataclass(frozen=True)
class ParityHop:
    """One hop of the model's chain (training forward -> export -> quantized -> served): what was compared with
    what, the measure, its measured value and the tolerance it was held to (None: a figure, not gated)."""

    hop: str
    compared: str
    measure: str
    measured: float
    tolerance: float | None
    upper: bool
    """The tolerance is an upper bound (a deviation) or a lower one (an agreement share)."""
    passed: bool | None
    source: str
    """The record the figures come from."""


def hop(hop: str, compared: str, measure: str, measured: float, tolerance: float | None, upper: bool,
        source: str) -> ParityHop:  # fmt: skip
    """A hop judged against its tolerance (a figure when there is none)."""
    passed = None if tolerance is None else (measured <= tolerance if upper else measured >= tolerance)
    return ParityHop(hop, compared, measure, measured, tolerance, upper, passed, source)


@dataclass(frozen=True)
class QualityFigures:
    """Generation quality of greedy continuations of held-out text against the true continuations."""

    prompts: int
    rouge_l: float
    bleu4: float


@dataclass(frozen=True)
class ServingCheck:
    """One judged figure: name, measured value, threshold, verdict and what to look at when it fails."""

    name: str
    measured: float | None
    threshold: float | None
    passed: bool | None
    message: str


def compare_greedy(ours: list[list[int]], served: list[list[int]], tokens: int) -> ParityFigures:
    """Compare the first `tokens` greedy tokens per prompt; a shorter served completion is a mismatch."""
    matched, mismatches = 0, []
    for i, (a, b) in enumerate(zip(ours, served, strict=True)):
        a, b = list(a[:tokens]), list(b[:tokens])
        if a == b:
            matched += 1
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        mismatches.append({"prompt": i, "position": pos, "ours": a, "served": b})
    return ParityFigures(prompts=len(ours), tokens=tokens, matched=matched, first_mismatch=mismatches)


def score_quality(predictions: list[str], references: list[str]) -> QualityFigures:
    """ROUGE-L F1 (rouge-score, mean over prompts) and corpus BLEU-4 (sacrebleu) of predictions vs references."""
    import sacrebleu
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    rouge = [scorer.score(ref, pred)["rougeL"].fmeasure for pred, ref in zip(predictions, references, strict=True)]
    bleu = sacrebleu.corpus_bleu(predictions, [references]).score
    return QualityFigures(
        prompts=len(predictions), rouge_l=float(sum(rouge) / len(rouge)) if rouge else 0.0, bleu4=float(bleu)
    )


def gate(name: str, value: float | None, limit: float | None, upper: bool, fix: str) -> ServingCheck:
    """One figure against its bound (None: not gated); an unmeasured (None or NaN) figure fails."""
    if limit is None:
        return ServingCheck(name, value, None, None, "not gated")
    if value is None or math.isnan(value):
        return ServingCheck(name, value, limit, False, f"{name} was not measured; {fix}")
    ok = value <= limit if upper else value >= limit
    sign = "<=" if upper else ">="
    message = (
        f"{name}={value:.4g} {sign} {limit:.4g}" if ok else f"{name}={value:.4g}, must be {sign} {limit:.4g}; {fix}"
    )
    return ServingCheck(name, value, limit, ok, message)


def judge(
    load: LoadFigures,
    parity: ParityFigures,
    quality: QualityFigures,
    thresholds: ServingThresholds,
    devices: int = 1,
) -> list[ServingCheck]:
    """Every gated figure against its threshold, as one table (what, value, limit, upper or lower bound, fix)."""
    none_completed = (
        f"none of the load test's {load.requests} requests completed, so no latency was measured: the load "
        "generator's log and the server log say why (a server that died is named in the check)"
    )
    table: list[tuple[str, float | None, float | None, bool, str]] = [
        (
            "p99_e2e_latency_ms",
            load.e2e_ms.p99,
            thresholds.p99_e2e_latency_ms_max,
            True,
            none_completed
            if load.completed <= 0
            else "look at the server log for preemptions (KV cache too small: raise serve.kv_cache_gib) and at "
            "waiting requests (raise serve.max_num_seqs), or lower serve.check.max_concurrency",
        ),
        (
            "p99_ttft_ms",
            load.ttft_ms.p99,
            thresholds.p99_ttft_ms_max,
            True,
            none_completed
            if load.completed <= 0
            else "prefill is slow or requests queue: raise serve.max_num_seqs or add replicas",
        ),
        (
            "error_rate",
            load.error_rate,
            thresholds.error_rate_max,
            True,
            "the load generator's errors and the server log say why requests failed",
        ),
        (
            "output_tokens_per_s_per_device",
            load.output_tokens_per_s / max(devices, 1),
            thresholds.output_tokens_per_s_min,
            False,
            "compare with benchmarks/serving.py on this hardware; check the dtype and serve.max_num_seqs",
        ),
        (
            "greedy_match",
            parity.share,
            thresholds.greedy_match_min,
            False,
            "the served model differs from the trained one: check the export (config.json, weight names, "
            "dtype) against the checkpoint; serving.json lists the first differing tokens",
        ),
        (
            "rouge_l",
            quality.rouge_l,
            thresholds.rouge_l_min,
            False,
            "generation quality is below the spec's threshold: train longer or check the data",
        ),
        ("bleu4", quality.bleu4, thresholds.bleu4_min, False, "as for rouge_l"),
    ]
    return [gate(*row) for row in table]
