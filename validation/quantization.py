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
    """Its own greedy continuation of each prompt (free-running)."""
    p99_e2e_ms: float
    output_tokens_per_s: float
    server_rss_bytes: int | None
    """Resident memory of the server's processes with the model loaded (None where it could not be read)."""
    weight_bytes: int
    forced_top1: list[list[int]] | None = None
    """Its most likely next token at each position of the unquantized model's greedy continuation, given that
    continuation's prefix (teacher-forced; None where not measured)."""


@dataclass(frozen=True)
class AgreementFigures:
    """Next-token agreement of the quantized model with the unquantized one's greedy continuation, position by
    position and teacher-forced (`matched`), and how many prompts its own greedy continuation reproduced whole."""

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


def greedy_agreement(
    reference: list[list[int]], forced: list[list[int]], tokens: int, free: list[list[int]] | None = None
) -> AgreementFigures:
    """How many of the first `tokens` positions of the reference's greedy continuation of each prompt the quantized
    model predicts as the reference did, given the reference's tokens before it (`forced`: its most likely next
    token there; a missing one counts as a mismatch), and how many prompts its own continuation (`free`; `forced`
    when not given) reproduces whole.

    Teacher-forced on purpose: free-running, the two models continue their own output, so one near-tie flipped at
    the second token makes every later position differ, and a model of unchanged perplexity fails on a coin toss
    (measured: -0.12% perplexity, 77% free-running agreement); forced, that flip costs the one position."""
    matched = identical = 0
    for ours, theirs, own in zip(reference, forced, free if free is not None else forced, strict=True):
        matched += sum(1 for i in range(tokens) if i < len(ours) and i < len(theirs) and ours[i] == theirs[i])
        identical += own[:tokens] == ours[:tokens] and len(ours) >= tokens
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
            f"{agreement.matched}/{agreement.tokens} next tokens along the unquantized model's greedy continuations "
            f"predicted as it did ({agreement.share:.1%}; at least {min_greedy_agreement:.1%}); "
            f"{agreement.prompts_identical}/{agreement.prompts} prompts continued identically on their own",
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
