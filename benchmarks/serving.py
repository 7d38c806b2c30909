"""Serving throughput and latency: vLLM's OpenAI server against transformers' static-batch `generate`.

On one exported model and the same prompts, at 1, 4 and 16 concurrent requests (a closed loop: a new request
as soon as one finishes for vLLM, a new round once the batch finishes for transformers):
- vLLM (continuous batching, paged KV cache): `vllm bench serve` against one server started for the whole run,
  through the serving check's own load test (tasks/serve/load.py), EOS ignored.
- transformers' `generate` in this process, the baseline one writes without a server: batches of up to C
  prompts padded left, greedy, exactly N new tokens. All C requests of a round arrive together, so each one's
  latency is the time from the round's start until its batch finishes.
For each concurrency it prints output tokens/s and P50/P99 end-to-end request latency of both, and the ratios
vLLM/transformers throughput and transformers/vLLM P99. The two sides alternate within each concurrency (which
goes first swaps every time) since these machines are shared and noisy; with --repeats each figure is the
median of the repeats. Beside each repeat's tokens/s it prints the cores other processes kept busy meanwhile
(/proc/stat less this process, its children and the server), so that a disturbed measurement shows.

The model is --model-dir (an exported Hugging Face folder) or, by default, a freshly initialised model of
examples/local.yaml's shape (or --preset 1b, a ~1B Llama shape for a GPU) on that spec's dataset, saved as our
DCP checkpoint with its model card and exported by tasks/export, so that the run also exercises the export.
Prompts are P tokens of the held-out split of --dataset, else of Python's own topic documentation (pydoc_data).

Usage: python benchmarks/serving.py [--model-dir DIR | --preset 1b | --d-model 64 --layers 2 --heads 2
       --kv-heads 1 --ffn 172] [--dataset URL] [--device cpu|cuda] [--dtype float32] [--prompts 32]
       [--prompt-tokens 32] [--output-tokens 16] [--concurrency 1 4 16] [--repeats 3] [--json OUT] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import yaml

if TYPE_CHECKING:
    from tasks.serve.server import Server

REPO = Path(__file__).resolve().parents[1]
LOCAL_SPEC = REPO / "examples" / "local.yaml"
PRESETS = {
    "1b": {"d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 8192,
           "vocab_size": 32000, "seq_len": 2048},
}  # fmt: skip
PRESET_DTYPE = {"1b": "bfloat16"}
SERVED_NAME = "bench"
SETTLE_S = 2.0  # vLLM's engine keeps a core busy for about a second after its last request; let it go idle
DISTURBED_CORES = 0.5  # others' load during a measurement above which the table says so
TOPIC_KEYS = 60  # pydoc topics (sorted) the default prompts are cut from: ~150k characters of reference text


@dataclass(frozen=True)
class Side:
    """One engine at one concurrency: throughput and end-to-end request latency."""

    output_tokens_per_s: float
    p50_ms: float
    p99_ms: float
    requests: int
    failed: int
    output_tokens: int
    duration_s: float
    others_cores: float = math.nan
    """Cores other processes on the machine kept busy meanwhile (OthersLoad): how disturbed the figures are."""


@dataclass(frozen=True)
class Row:
    """Both engines at one concurrency (each repeat's figures), their medians and the ratios."""

    concurrency: int
    vllm_runs: list[Side]
    transformers_runs: list[Side]

    @property
    def vllm(self) -> Side:
        """vLLM's figures, each the median over the repeats."""
        return median_side(self.vllm_runs)

    @property
    def transformers(self) -> Side:
        """transformers' figures, each the median over the repeats."""
        return median_side(self.transformers_runs)

    @property
    def throughput_ratio(self) -> float:
        """vLLM output tokens/s over transformers'."""
        return self.vllm.output_tokens_per_s / self.transformers.output_tokens_per_s

    @property
    def p99_ratio(self) -> float:
        """transformers' P99 end-to-end latency over vLLM's."""
        return self.transformers.p99_ms / self.vllm.p99_ms

    def to_json(self) -> dict[str, Any]:
        """The medians, the ratios and every repeat's figures."""
        medians = {"vllm": asdict(self.vllm), "transformers": asdict(self.transformers)}
        ratios = {"throughput_ratio": self.throughput_ratio, "p99_ratio": self.p99_ratio}
        return {"concurrency": self.concurrency, **medians, **ratios, "runs": asdict(self)}


def median_side(sides: list[Side]) -> Side:
    """Each figure's median over the repeats."""
    if len(sides) == 1:
        return sides[0]
    values = {name: statistics.median(getattr(s, name) for s in sides) for name in Side.__dataclass_fields__}
    ints = ("requests", "failed", "output_tokens")
    return Side(**{k: (int(v) if k in ints else float(v)) for k, v in values.items()})


def _machine_busy_s() -> float:
    """CPU seconds the machine's kernel has run anything (every process, other containers too): /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds of the live processes of process group `pgid` (the vLLM server and its engine processes)."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split() if stat else []
        if fields and int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


class OthersLoad:
    """From its creation on: the cores that processes other than this one, its children (the load generator)
    and the vLLM server kept busy; on this shared machine, how much a measurement had to share it."""

    def __init__(self, server_pgid: int) -> None:
        self.pgid = server_pgid
        self.start = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        own = sum(
            usage.ru_utime + usage.ru_stime
            for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
        )
        return time.perf_counter(), _machine_busy_s(), own + _group_cpu_s(self.pgid)

    def cores(self) -> float:
        """Mean cores the others used since the start."""
        (t0, busy0, ours0), (t1, busy1, ours1) = self.start, self._sample()
        return max(0.0, (busy1 - busy0 - (ours1 - ours0)) / (t1 - t0))


def model_shape(args: argparse.Namespace, local: dict[str, Any]) -> dict[str, Any]:
    """The spec's model section with the preset's shape or the --d-model/--layers/--heads/--kv-heads/--ffn ones."""
    shape = {**local, **PRESETS.get(args.preset, {})}
    given = {
        "d_model": args.d_model,
        "n_layers": args.layers,
        "n_heads": args.heads,
        "n_kv_heads": args.kv_heads,
        "ffn_hidden": args.ffn,
    }
    if args.d_model is not None and args.ffn is None:
        given["ffn_hidden"] = -(-8 * args.d_model // 12) * 4  # SwiGLU's 8/3 d_model up to a multiple of 4 (64 -> 172)
    shape.update({key: value for key, value in given.items() if value is not None})
    return shape


def export_fresh_model(args: argparse.Namespace, work: Path) -> tuple[Path, Any]:
    """A freshly initialised model of examples/local.yaml's shape (or the preset's), saved as a DCP checkpoint
    with its model card on the spec's dataset (prepared here unless --dataset) and exported; the folder."""
    from tasks.export.step import export_checkpoint
    from tasks.prepare.pipeline import prepare_dataset
    from tasks.spec import parse_spec
    from training.checkpoint import CheckpointManager, ModelCard
    from training.dataset import read_manifest
    from training.model import Transformer

    data = yaml.safe_load(LOCAL_SPEC.read_text())
    data["name"], data["deployment_dir"] = "bench-serving", str(work / "run")
    data["model"] = model_shape(args, data["model"])
    if args.dataset is not None:
        data["data"] = {"dataset_url": args.dataset}
        vocab = read_manifest(args.dataset).vocab_size
        data["model"]["vocab_size"] = max(data["model"]["vocab_size"], vocab)  # the embedding covers every id
    spec = parse_spec(data, str(LOCAL_SPEC))
    if spec.data.prepare is not None:
        prepared = prepare_dataset(spec.data.prepare, spec.storage, validate=False)
        train = spec.training_config(prepared.dataset_url, prepared.tokenizer_sha256)
    else:
        train = spec.training_config()
    torch.manual_seed(args.seed)
    model = Transformer(train.model)
    manifest = read_manifest(train.data.dataset_url, train.storage)
    card = ModelCard.of_run(train, manifest).model_dump(mode="json")
    manager = CheckpointManager(train.checkpoint, train.storage, card=card)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.optim.lr_peak)
    manager.save(0, model, optimizer, {"step": 0})
    del model, optimizer
    exported = export_checkpoint(train, 0, work / "model")
    return Path(exported.model_dir), exported


def prompt_texts(tokenizer: Any, windows: list[list[int]]) -> list[str]:
    """Each window of ids as text that encodes back to at most as many tokens (BPE may merge across a cut)."""
    texts = []
    for ids in windows:
        text = tokenizer.decode(ids)
        while len(tokenizer.encode(text).ids) > len(ids):
            ids = ids[:-1]
            text = tokenizer.decode(ids)
        texts.append(text)
    return texts


def make_prompts(model_dir: Path, dataset: str | None, count: int, tokens: int) -> tuple[list[str], str]:
    """`count` prompts of `tokens` tokens, spread over the held-out split of `dataset` (the training split when
    it has none; its tokenizer must be the model's), else over Python's topic docs; and where they came from."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if dataset is not None:
        from training.dataset import TokenDataset, read_manifest

        split = "val" if "val" in read_manifest(dataset).splits else "train"
        data = TokenDataset(dataset, split, tokens - 1)
        if len(data) < count:
            raise SystemExit(
                f"--dataset {dataset}: its {split} split has {len(data)} prompts of {tokens} tokens, "
                f"not {count}; lower --prompts or --prompt-tokens"
            )
        stride = len(data) // count
        windows = [data.sample(i * stride).tolist() for i in range(count)]
        source = f"{dataset} ({split} split)"
    else:
        from pydoc_data.topics import topics

        ids = tokenizer.encode("\n\n".join(topics[key].strip() for key in sorted(topics)[:TOPIC_KEYS])).ids
        stride = len(ids) // count
        if stride < tokens:
            raise SystemExit(f"Python's topic docs give {len(ids)} tokens, too few for {count} x {tokens}")
        windows = [ids[i * stride : i * stride + tokens] for i in range(count)]
        source = f"pydoc_data.topics (first {TOPIC_KEYS} topics)"
    return prompt_texts(tokenizer, windows), source


def vllm_side(server: Server, model_dir: Path, prompts: list[str], concurrency: int, tokens: int, out: Path) -> Side:
    """`vllm bench serve` at `concurrency` (the serving check's load test); its figures."""
    from tasks.serve.check import ServingCheckConfig
    from tasks.serve.load import run_load_test

    check = ServingCheckConfig(
        num_prompts=len(prompts), output_tokens=tokens, max_concurrency=concurrency, load_timeout_s=1800
    )
    load, _ = run_load_test(server, model_dir, prompts, check, out)
    return Side(
        load.output_tokens_per_s,
        load.e2e_ms.p50,
        load.e2e_ms.p99,
        load.requests,
        load.failed,
        load.output_tokens,
        load.duration_s,
    )


def transformers_side(model: Any, tokenizer: Any, prompts: list[str], concurrency: int, new_tokens: int) -> Side:
    """Static batching with `generate`: rounds of `concurrency` prompts padded left, greedy, `new_tokens` each;
    a request's latency is its round's (all of a round's requests arrive at its start)."""
    latencies, produced = [], 0
    device = model.device
    started = time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        batch = prompts[first : first + concurrency]
        round_start = time.perf_counter()
        inputs = tokenizer(batch, return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            out = model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed_ms = 1000 * (time.perf_counter() - round_start)
        generated = out.shape[1] - inputs["input_ids"].shape[1]
        assert generated == new_tokens, f"generate returned {generated} new tokens, not {new_tokens}"
        latencies += [elapsed_ms] * len(batch)
        produced += generated * len(batch)
    duration_s = time.perf_counter() - started
    p50, p99 = np.percentile(latencies, [50, 99])  # as vllm bench computes its percentiles
    return Side(produced / duration_s, float(p50), float(p99), len(prompts), 0, produced, duration_s)


def load_transformers(model_dir: Path, dtype: str, device: str) -> tuple[Any, Any]:
    """The exported folder in transformers: the model in eval mode on `device`, its tokenizer padding left."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()  # generate's note that max_new_tokens overrides max_length, per call
    transformers.logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    return model, tokenizer


def print_table(rows: list[Row]) -> None:
    """The figures of both engines and the ratios, one line per concurrency."""
    print(f"{'':>5} | {'vLLM (bench serve)':^28} | {'transformers generate':^28} | {'ratios':^21}")
    head = f"{'tok/s':>8} {'P50 ms':>9} {'P99 ms':>9}"
    print(f"{'conc':>5} | {head} | {head} | {'tput v/t':>9} {'P99 t/v':>9}")
    for row in rows:
        v, t = row.vllm, row.transformers
        print(
            f"{row.concurrency:>5} | {v.output_tokens_per_s:8.1f} {v.p50_ms:9.1f} {v.p99_ms:9.1f} | "
            f"{t.output_tokens_per_s:8.1f} {t.p50_ms:9.1f} {t.p99_ms:9.1f} | "
            f"{row.throughput_ratio:9.2f} {row.p99_ratio:9.2f}"
        )
    busiest = max(side.others_cores for row in rows for side in (*row.vllm_runs, *row.transformers_runs))
    if busiest > DISTURBED_CORES:
        print(
            f"other processes kept up to {busiest:.1f} cores busy during a measurement (the figures in brackets "
            "above): rerun on a quieter machine, or with more --repeats, before trusting the ratios"
        )
    failed = {row.concurrency: row.vllm.failed for row in rows if row.vllm.failed}
    if failed:
        print(f"vLLM requests failed (concurrency: count): {failed}; its figures count completed requests only")


def main() -> None:
    """Export (or take) the model, start one vLLM server, measure both engines at each concurrency, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="an exported Hugging Face folder (default: export a new one)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a model shape instead of examples/local.yaml's")
    parser.add_argument("--d-model", type=int, help="hidden size of the new model")
    parser.add_argument("--layers", type=int, help="blocks of the new model")
    parser.add_argument("--heads", type=int, help="attention heads of the new model (vLLM's CPU needs head_dim 32+)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads of the new model")
    parser.add_argument("--ffn", type=int, help="MLP hidden size of the new model (default: 8/3 of --d-model)")
    parser.add_argument("--dataset", help="a prepared dataset (URL): prompts from its held-out split, its tokenizer")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where transformers runs")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="both engines' dtype (default: float32, bfloat16 for --preset 1b)",
    )
    parser.add_argument("--prompts", type=int, default=32, help="requests per concurrency and engine")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each prompt (P)")
    parser.add_argument("--output-tokens", type=int, default=16, help="new tokens of each request (N)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="concurrent requests (C)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating measurements of each side (median)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the new model's weights")
    parser.add_argument("--json", type=Path, help="write the setup and the figures there")
    parser.add_argument("--work", type=Path, help="keep the checkpoint, export and logs here (default: a temp dir)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dtype = args.dtype or PRESET_DTYPE.get(args.preset, "float32")
    work = args.work or Path(tempfile.mkdtemp(prefix="tdeploy-bench-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        run(args, dtype, work, started)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, dtype: str, work: Path, started: float) -> None:
    """The benchmark proper (main sets up and cleans up the work folder)."""
    from tasks.launch.torchrun import free_port
    from tasks.serve.config import ServeConfig
    from tasks.serve.server import start_server

    if args.model_dir is None:
        model_dir, exported = export_fresh_model(args, work)
        built = f"new model exported by tasks/export: {exported.architecture}, {exported.n_params:,} parameters"
    else:
        model_dir, built = args.model_dir.resolve(), "given folder"
    config = json.loads((model_dir / "config.json").read_text())
    max_model_len = min(int(config.get("max_position_embeddings", 4096)), 4096)
    if args.prompt_tokens + args.output_tokens > max_model_len:
        raise SystemExit(
            f"--prompt-tokens {args.prompt_tokens} + --output-tokens {args.output_tokens} exceed the "
            f"model's {max_model_len} positions; lower them"
        )
    prompts, source = make_prompts(model_dir, args.dataset, args.prompts, args.prompt_tokens)
    model, tokenizer = load_transformers(model_dir, dtype, args.device)
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    print(
        f"model {model_dir} ({built}); {dtype}, transformers on {args.device}, torch {torch.get_num_threads()} "
        f"threads; prompts from {source}: {len(prompts)} x {min(lengths)}-{max(lengths)} tokens -> "
        f"{args.output_tokens} new tokens; repeats {args.repeats}"
    )
    serve = ServeConfig(dtype=dtype, port=free_port(), max_num_seqs=max(args.concurrency))
    up = time.perf_counter()
    server = start_server(model_dir, serve, SERVED_NAME, max_model_len, work / "server.log")
    try:
        server_start_s = time.perf_counter() - up
        print(
            f"vLLM server up in {server_start_s:.0f} s (max_model_len {max_model_len}, max_num_seqs "
            f"{serve.max_num_seqs}, KV cache {serve.kv_cache_gib:g} GiB on CPU)",
            flush=True,
        )
        transformers_side(model, tokenizer, prompts[: max(args.concurrency)], max(args.concurrency), 2)  # warm-up
        rows = []
        for index, concurrency in enumerate(args.concurrency):
            runs: dict[str, list[Side]] = {"vllm": [], "transformers": []}
            for repeat in range(args.repeats):
                order = ["vllm", "transformers"] if (index + repeat) % 2 == 0 else ["transformers", "vllm"]
                for side in order:
                    time.sleep(SETTLE_S)
                    others = OthersLoad(server.pid)
                    if side == "vllm":
                        out = work / f"bench-c{concurrency}-r{repeat}"
                        result = vllm_side(server, model_dir, prompts, concurrency, args.output_tokens, out)
                    else:
                        result = transformers_side(model, tokenizer, prompts, concurrency, args.output_tokens)
                    runs[side].append(replace(result, others_cores=others.cores()))
            rows.append(Row(concurrency, runs["vllm"], runs["transformers"]))
            each = "; ".join(
                f"{side} " + " ".join(f"{r.output_tokens_per_s:.0f} ({r.others_cores:.1f})" for r in sides)
                for side, sides in runs.items()
            )
            elapsed_s = time.perf_counter() - started
            print(
                f"  concurrency {concurrency}: tok/s (others' cores) of each repeat: {each} ({elapsed_s:.0f} s)",
                flush=True,
            )
    finally:
        server.stop()
    print_table(rows)
    wall_s = time.perf_counter() - started
    print(f"wall time {wall_s:.0f} s (vLLM server start {server_start_s:.0f} s)")
    if args.json is not None:
        setup = {
            "argv": sys.argv,
            "model_dir": str(model_dir),
            "model": built,
            "dtype": dtype,
            "device": args.device,
            "prompts": len(prompts),
            "prompt_source": source,
            "prompt_tokens": [min(lengths), max(lengths)],
            "output_tokens": args.output_tokens,
            "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(),
            "server_start_s": server_start_s,
            "wall_s": wall_s,
        }
        args.json.write_text(json.dumps({"setup": setup, "rows": [row.to_json() for row in rows]}, indent=2))


if __name__ == "__main__":
    main()
