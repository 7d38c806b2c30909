"""The quantization gate as plain functions: perplexity on held-out data, greedy agreement with the unquantized
model, and memory, P99 latency and throughput set against the unquantized model served the same way.

Both models are measured through the same vLLM server settings (tasks/quantize/gate.py); this module only turns
the measurements into figures and judges them. Perplexity and agreement are gated (the spec's
`quantize.max_ppl_increase` and `quantize.min_greedy_agreement`); memory, latency and throughput are reported as
ratios, not gated: on a CPU a quantized kernel can be slower than fp32 and still be the model one wants to ship.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ServedModelFigures:
    """What one served model measured: perplexity, greedy tokens, latency, throughput and memory."""

    model_dir: str
    perplexity: float
    eval_tokens: int
    """Tokens whose log-probability the perplexity averages (every sequence's first token has none)."""
    greedy: list[list[int]]
    p99_e2e_ms: float
    output_tokens_per_s: float
    server_rss_bytes: int | None
    """Resident memory of the server's processes with the model loaded (None where it could not be read)."""
    weight_bytes: int


@dataclass(frozen=True)
class AgreementFigures:
    """Greedy tokens of the quantized model against the unquantized one, position by position."""

    prompts: int
    tokens: int
    matched: int
    prompts_identical: int

    @property
    def share(self) -> float:
        """Matched tokens over all compared."""
        return self.matched / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class QuantizationCheck:
    """One judged figure: its name, the measured value, the bound, and whether it passed (None: a figure only)."""

    name: str
    value: float | None
    bound: float | None
    passed: bool | None
    message: str


def perplexity(token_logprobs: list[list[float]]) -> tuple[float, int]:
    """exp of the mean negative log-probability over every scored token of every sequence; and the token count."""
    scored = [lp for sequence in token_logprobs for lp in sequence]
    if not scored:
        raise ValueError("no token log-probabilities to score")
    return math.exp(-sum(scored) / len(scored)), len(scored)


def greedy_agreement(reference: list[list[int]], quantized: list[list[int]], tokens: int) -> AgreementFigures:
    """How many of the first `tokens` greedy tokens of each prompt the quantized model shares with the reference
    at the same position (a missing token counts as a mismatch)."""
    matched = identical = 0
    for ours, theirs in zip(reference, quantized, strict=True):
        same = sum(1 for i in range(tokens) if i < len(ours) and i < len(theirs) and ours[i] == theirs[i])
        matched += same
        identical += same == tokens
    return AgreementFigures(len(reference), len(reference) * tokens, matched, identical)


def _ratio(new: float | None, old: float | None) -> float | None:
    return new / old if new is not None and old else None


def judge_quantization(
    base: ServedModelFigures,
    quantized: ServedModelFigures,
    agreement: AgreementFigures,
    max_ppl_increase: float,
    min_greedy_agreement: float,
) -> list[QuantizationCheck]:
    """The gate: perplexity increase and greedy agreement against their bounds; memory, P99 and throughput as
    ratios quantized / unquantized."""
    increase = quantized.perplexity / base.perplexity - 1.0
    checks = [
        QuantizationCheck(
            "perplexity_increase", increase, max_ppl_increase, increase <= max_ppl_increase,
            f"perplexity {base.perplexity:.4f} -> {quantized.perplexity:.4f} ({increase:+.2%}; at most "
            f"{max_ppl_increase:+.2%}) on {quantized.eval_tokens} held-out tokens",
        ),
        QuantizationCheck(
            "greedy_agreement", agreement.share, min_greedy_agreement, agreement.share >= min_greedy_agreement,
            f"{agreement.matched}/{agreement.tokens} greedy tokens equal to the unquantized model's "
            f"({agreement.share:.1%}; at least {min_greedy_agreement:.1%}); {agreement.prompts_identical}/"
            f"{agreement.prompts} prompts identical",
        ),
    ]  # fmt: skip
    figures = (
        ("weight_bytes_ratio", quantized.weight_bytes, base.weight_bytes, "weights on disk", "{:,} B"),
        ("server_rss_ratio", quantized.server_rss_bytes, base.server_rss_bytes, "server resident memory", "{:,} B"),
        ("p99_e2e_ratio", quantized.p99_e2e_ms, base.p99_e2e_ms, "P99 end-to-end latency", "{:.1f} ms"),
        ("throughput_ratio", quantized.output_tokens_per_s, base.output_tokens_per_s, "output tokens/s", "{:.0f}"),
    )
    for name, new, old, what, unit in figures:
        ratio = _ratio(new, old)
        shown = "n/a" if ratio is None else f"x{ratio:.3f}"
        before = "n/a" if old is None else unit.format(old)
        after = "n/a" if new is None else unit.format(new)
        checks.append(QuantizationCheck(name, ratio, None, None, f"{what} {before} -> {after} ({shown})"))
    return checks
