"""The serving check: export the accepted checkpoint, serve it with vLLM, load-test it, compare its greedy
completions with our own model's, score its generations, and judge it all against the spec's thresholds."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import Field

from tasks.errors import TransientError, UserError
from tasks.progress import report as report_progress
from tasks.serve.chain import ParityChain, parity_chain
from training.config import ModelConfig, StrictModel, TrainConfig
from training.storage import is_local, local_path
from validation.serving import (
    LatencyFigures,
    LoadFigures,
    LogprobFigures,
    ParityFigures,
    QualityFigures,
    ServerFigures,
    ServingCheck,
    ServingThresholds,
    compare_greedy,
    judge,
    logprob_deviation,
    score_quality,
)

if TYPE_CHECKING:
    from tasks.export.readme import AcceptanceFigures
    import torch

    from tasks.serve.config import ServeConfig
    from tasks.serve.server import Server

log = logging.getLogger(__name__)

SERVING_JSON = "serving.json"
JUNIT = "junit.xml"
HISTOGRAM = "latency_histogram.png"
BENCH_JSON = "bench.json"
PROMPTS = "prompts.jsonl"
_EXIT_GRACE_S = 5.0  # a request cut by a dying server fails a moment before the process is gone


class ServingCheckConfig(StrictModel):
    """The serving check's load test, parity and quality probes, and its thresholds (`serve.check`)."""

    num_prompts: int = Field(default=32, ge=1, le=100_000, description="Requests the load test sends.")
    prompt_tokens: int = Field(
        default=32, ge=1, le=1_048_576, description="Tokens of held-out text in each prompt (load, parity, quality)."
    )
    output_tokens: int = Field(
        default=16, ge=1, le=1_048_576, description="Tokens each load-test and quality request generates."
    )
    max_concurrency: int = Field(default=4, ge=1, le=100_000, description="Load test: most requests in flight.")
    request_rate_per_s: float | None = Field(
        default=None,
        gt=0,
        description="Load test: Poisson arrival rate; None = send as fast as the concurrency allows.",
    )
    parity_prompts: int = Field(default=4, ge=1, le=10_000, description="Prompts of the greedy parity check.")
    parity_tokens: int = Field(default=8, ge=1, le=4096, description="Greedy tokens compared per parity prompt.")
    quality_prompts: int = Field(default=16, ge=1, le=10_000, description="Held-out continuations scored.")
    metrics_interval_s: float = Field(
        default=0.5, gt=0, le=60, description="How often the server's /metrics are sampled during the load test."
    )
    load_timeout_s: float = Field(default=1800.0, gt=0, le=86_400, description="Most time the load test may take.")
    thresholds: ServingThresholds = Field(default_factory=ServingThresholds)


def check_problems(model: ModelConfig, serve: ServeConfig, check: ServingCheckConfig) -> list[str]:
    """Why the check's prompts cannot fit the served context (empty when they do), each with the fix."""
    limit = serve.max_model_len or model.seq_len
    longest = check.prompt_tokens + max(check.output_tokens, check.parity_tokens)
    if longest > limit:
        return [
            f"serve.check.prompt_tokens={check.prompt_tokens} + output_tokens={check.output_tokens}: {longest} "
            f"tokens exceed the served context of {limit} (serve.max_model_len or model.seq_len); lower them"
        ]
    return []


@dataclass(frozen=True)
class HeldOut:
    """Prompts and their true continuations, as token ids, from the dataset's held-out split."""

    prompts: list[list[int]]
    continuations: list[list[int]]
    split: str


def held_out(train: TrainConfig, check: ServingCheckConfig, count: int) -> HeldOut:
    """`count` samples of the held-out split (the training split when there is none), cut into prompt and
    continuation; spread over the split so that they are not one document."""
    from training.dataset import TokenDataset, read_manifest

    length = check.prompt_tokens + check.output_tokens
    url = train.data.dataset_url
    splits = read_manifest(url, train.storage, train.data.sources).splits
    split = train.data.val_split if train.data.val_split in splits else train.data.train_split
    data = TokenDataset(
        url, split, length - 1, train.storage, vocab_size=train.model.vocab_size, trusted=train.data.sources
    )
    stride = max(1, len(data) // count)
    indices = [(i * stride) % len(data) for i in range(count)]
    samples = [data.sample(i).tolist() for i in indices]
    return HeldOut(
        [s[: check.prompt_tokens] for s in samples], [s[check.prompt_tokens : length] for s in samples], split
    )


def load_our_model(train: TrainConfig, step: int) -> torch.nn.Module:
    """Our own model (training/model.py) with the weights of checkpoint `step` (already checked sound by the
    export), in eval mode, fp32, on CPU."""
    import torch

    from training.checkpoint import CheckpointManager
    from training.model import Transformer

    model = Transformer(train.model)
    CheckpointManager(train.checkpoint, train.storage).load_model(step, model)
    return model.eval().to(torch.float32)


def our_greedy(model: torch.nn.Module, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy completions of our model: argmax of the last position, `tokens` times, EOS not special."""
    import torch

    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], dtype=torch.long)
            for _ in range(tokens):
                logits, _ = model(ids)
                ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            out.append(ids[0, len(prompt) :].tolist())
    return out


def our_logprobs(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[float]]:
    """Our model's log-probability of each token of each prompt after the ones before it (all but the first), as
    the server's prompt_logprobs give them."""
    import torch

    out = []
    with torch.no_grad():
        for prompt in prompts:
            logits, _ = model(torch.tensor([prompt], dtype=torch.long))
            logprobs = torch.log_softmax(logits[0, :-1].float(), dim=-1)
            out.append(logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1).tolist())
    return out


REQUEST_TIMEOUT_S = 600.0
"""How long one request to our own server may take: a bound on a stuck server, not a latency figure (the first
requests to a vLLM-CPU server on a loaded machine took over 120 s)."""


def post_json(url: str, body: dict[str, Any], timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """POST `body` as JSON to our own server; its JSON answer. A request the server refuses (4xx) is a UserError
    quoting the server's reason; one that fails otherwise a TransientError."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - our own loopback server
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        reason = err.read().decode("utf-8", "replace")[:2000]
        if 400 <= err.code < 500:
            raise UserError(f"serving check: the server at {url} refused a request (HTTP {err.code}): {reason}",
                            "see the server log; the request's lengths come from serve.check and quantize") from err  # fmt: skip
        raise TransientError(f"serving check: request to {url} failed (HTTP {err.code}): {reason}",
                             "see the server log") from err  # fmt: skip
    except OSError as err:
        raise TransientError(f"serving check: request to {url} failed: {err}", "see the server log") from err


def prompt_logprobs(server: Server, sequence: list[int]) -> list[float]:
    """The server's log-probability of each token of `sequence` after the ones before it (all but the first)."""
    body = {"model": server.served_name, "prompt": sequence, "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": 0}  # fmt: skip
    scored = post_json(f"{server.url}/v1/completions", body)["choices"][0].get("prompt_logprobs")
    if not scored or len(scored) != len(sequence):
        raise UserError(
            f"the vLLM server at {server.url} returned no prompt log-probabilities for a {len(sequence)}-token "
            "prompt", "serve with a vLLM that supports prompt_logprobs (vLLM >= 0.6)",
        )  # fmt: skip
    return [float(entry[str(token)]["logprob"]) for entry, token in zip(scored[1:], sequence[1:], strict=True)]


def forced_top1(server: Server, prompt: list[int], continuation: list[int]) -> list[int]:
    """The server's most likely next token at each position of `continuation` after `prompt`, given the tokens of
    `continuation` before it (teacher-forced: from the prompt log-probabilities of prompt + continuation, top 1)."""
    sequence = [*prompt, *continuation]
    body = {"model": server.served_name, "prompt": sequence, "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": 1}  # fmt: skip
    scored = post_json(f"{server.url}/v1/completions", body)["choices"][0].get("prompt_logprobs")
    if not scored or len(scored) != len(sequence):
        raise UserError(
            f"the vLLM server at {server.url} returned no prompt log-probabilities for a {len(sequence)}-token "
            "prompt", "serve with a vLLM that supports prompt_logprobs (vLLM >= 0.6)",
        )  # fmt: skip
    top = []
    for entry in scored[len(prompt) :]:  # entry j: the distribution after sequence[:j]
        ranked = [int(token) for token, info in entry.items() if int(info.get("rank") or 0) == 1]
        top.append(ranked[0] if ranked else -1)
    return top


def served_greedy(server: Server, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], list[str]]:
    """The server's greedy completions (temperature 0, EOS ignored) of token-id prompts: their ids and texts."""
    ids, texts = [], []
    for prompt in prompts:
        body = {
            "model": server.served_name,
            "prompt": prompt,
            "max_tokens": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        choice = post_json(f"{server.url}/v1/completions", body)["choices"][0]
        ids.append(list(choice.get("token_ids") or []))
        texts.append(choice.get("text", ""))
    return ids, texts


class MetricsSampler:
    """Samples the server's Prometheus /metrics in a thread while the load test runs (the maxima are kept)."""

    GAUGES = {
        "kv_cache_usage_max": "vllm:kv_cache_usage_perc",
        "running_max": "vllm:num_requests_running",
        "waiting_max": "vllm:num_requests_waiting",
    }

    def __init__(self, url: str, interval_s: float) -> None:
        self.url, self.interval_s = f"{url}/metrics", interval_s
        self.maxima: dict[str, float] = {}
        self.samples = 0
        self.last: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)

    def read(self) -> dict[str, float]:
        """One scrape: every sample's value by name (labels summed)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url, timeout=10) as resp:  # noqa: S310 - our own loopback server
            text = resp.read().decode()
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
        return values

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                values = self.read()
            except OSError as err:
                log.debug("metrics scrape failed: %s", err)
            else:
                self.samples += 1
                self.last = values
                for key, name in self.GAUGES.items():
                    if name in values:
                        self.maxima[key] = max(self.maxima.get(key, 0.0), values[name])
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MetricsSampler:
        try:  # the counters' values before the load, read before the load starts
            self.first = self.read()
        except OSError as err:
            log.warning("first metrics scrape failed: %s", err)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        try:
            self.last = self.read()
            self.samples += 1
        except OSError as err:
            log.warning("final metrics scrape failed: %s", err)

    def figures(self, output_tokens: int | None = None) -> ServerFigures:
        """The maxima, the engine's mean tokens per step and its preemptions over the load (the last scrape less
        the one before it), and how many of the load's `output_tokens` it decoded per step."""
        last = self.last
        steps = self._delta("vllm:iteration_tokens_total_count")
        tokens = self._delta("vllm:iteration_tokens_total_sum")
        return ServerFigures(
            samples=self.samples,
            kv_cache_usage_max=self.maxima.get("kv_cache_usage_max"),
            running_max=self.maxima.get("running_max"),
            waiting_max=self.maxima.get("waiting_max"),
            mean_batch_tokens=(tokens / steps) if steps and tokens is not None else None,
            preemptions=last.get("vllm:num_preemptions_total"),
            engine_steps=steps,
            output_tokens_per_step=(output_tokens / steps) if steps and output_tokens is not None else None,
        )

    def _delta(self, name: str) -> float | None:
        """A counter's growth from the first scrape to the last (None when the last lacks it)."""
        if name not in self.last:
            return None
        return self.last[name] - self.first.get(name, 0.0)


@dataclass(frozen=True)
class LatencyPlot:
    """What the latency histogram (tasks/serve/report.py) shows of a serving check of any model kind."""

    per_request_ms: list[float]
    figures: LatencyFigures
    """P50, P95, P99 of `per_request_ms`."""
    threshold_ms: float | None
    """The P99 threshold the check judged, None when none."""
    xlabel: str
    title: str


def p99_threshold(checks: list[ServingCheck], name: str) -> float | None:
    """The threshold of the judged figure `name` (None when it was not judged)."""
    return next((c.threshold for c in checks if c.name == name), None)


class Verdict(Protocol):
    """One judged figure of a report: its name and whether it passed (None: a figure only, not gated)."""

    name: str
    passed: bool | None


class Judged:
    """A report by its judged figures (`checks`): passed and the names that failed; shared by the language
    model's, the classifier's and the captioning check's reports and the quantize step's."""

    checks: Sequence[Verdict]

    @property
    def passed(self) -> bool:
        """No gated figure failed."""
        return all(c.passed is not False for c in self.checks)

    @property
    def failed(self) -> list[str]:
        """Names of the failed figures."""
        return [c.name for c in self.checks if c.passed is False]


@dataclass(frozen=True)
class ServingReport(Judged):
    """Everything the serving check measured and judged."""

    MODEL_KIND: ClassVar[str] = "lm"

    model_dir: str
    step: int
    url: str
    server_pid: int
    """The server's process (and process group) id: gone when the check ends."""
    accelerator: str
    devices: int
    load: LoadFigures
    server: ServerFigures
    parity: ParityFigures
    logprobs: LogprobFigures
    quality: QualityFigures
    checks: list[ServingCheck]
    chain: ParityChain
    """Training forward -> export -> quantized -> served: each hop's measured deviation and tolerance."""
    per_request_e2e_ms: list[float]
    files: dict[str, str]

    def latency_plot(self) -> LatencyPlot:
        """The load test's end-to-end latency per request, for the histogram."""
        return LatencyPlot(
            self.per_request_e2e_ms, self.load.e2e_ms, p99_threshold(self.checks, "p99_e2e_latency_ms"),
            "end-to-end latency per request (ms)",
            f"{self.load.requests} requests, concurrency {self.load.max_concurrency}, "
            f"{self.load.output_tokens_per_s:.0f} output tokens/s",
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """serving.json's content."""
        data = asdict(self)
        data.pop("per_request_e2e_ms")
        data["verdict"] = "passed" if self.passed else "failed"
        data["load"]["error_rate"] = self.load.error_rate
        data["parity"]["share"] = self.parity.share
        data["chain"]["passed"] = self.chain.passed
        return data


def served_folder(
    train: TrainConfig,
    step: int | None,
    model_dir: str | None,
    export_root: str | None,
    acceptance: AcceptanceFigures | None,
    server: str,
    stage: str = "serving",
) -> tuple[Path, int]:
    """The local folder to serve and its checkpoint step: the newest sound (or the given) checkpoint exported under
    `export_root` (as `tdeploy export` does), or `model_dir`, a finished folder of checkpoint `step`. `server` names
    what reads it (as "vLLM serves", "LLM Compressor and vLLM read") in the message about a non-local export;
    `stage` is the progress line's."""
    from tasks.export.step import export_checkpoint

    if model_dir is not None:
        assert step is not None, "a given model folder comes with its checkpoint step"
        return Path(model_dir), step
    report_progress(stage, "exporting the checkpoint")
    exported = export_checkpoint(train, step, export_root=export_root, acceptance=acceptance)
    if not is_local(exported.model_dir):
        raise UserError(
            f"the export went to {exported.model_dir}: {server} a local folder",
            "put the deployment folder (deployment_dir) on a local or shared filesystem",
        )
    return Path(local_path(exported.model_dir)), exported.step


def run_serving_check(
    serve: ServeConfig,
    train: TrainConfig,
    accelerator: str,
    name: str,
    out_dir: Path,
    export_root: str,
    step: int | None = None,
    model_dir: str | None = None,
    quantization_json: str | None = None,
    acceptance: AcceptanceFigures | None = None,
    pod_memory_bytes: float | None = None,
) -> ServingReport:
    """Export the newest sound (or the given) checkpoint under `export_root` (as `tdeploy export` does), serve it,
    measure it, write the reports into `out_dir`, stop the server; the report says whether it passed.

    `model_dir`: serve this finished folder of checkpoint `step` instead (the quantize step's quantized folder);
    greedy parity still compares with our own model of that step, and `quantization_json` (the quantize step's
    gate report) is the quantized hop of the parity chain; `acceptance`: the figures the model card shows;
    `pod_memory_bytes`: the serving plan's pod memory, the manifests' memory request and limit."""
    from tasks.serve.config import unservable
    from tasks.serve.report import write_reports
    from tasks.serve.server import SERVER_LOG, start_server, with_folder_dtype

    problems = unservable(train.model, serve, accelerator) + check_problems(train.model, serve, serve.check)
    if problems:
        raise UserError("; ".join(problems))
    check = serve.check
    out_dir.mkdir(parents=True, exist_ok=True)
    served, served_step = served_folder(train, step, model_dir, export_root, acceptance, "vLLM serves")
    serve = with_folder_dtype(serve, served)  # the dtype the run trained in, unless the spec names one
    count = max(check.parity_prompts, check.quality_prompts, check.num_prompts)
    data = held_out(train, check, count)
    model = load_our_model(train, served_step)
    ours = our_greedy(model, data.prompts[: check.parity_prompts], check.parity_tokens)
    ours_logprobs = our_logprobs(model, data.prompts[: check.parity_prompts])
    del model
    max_model_len = serve.max_model_len or train.model.seq_len
    started = time.monotonic()
    starting = f"starting the vLLM server (ready within serve.startup_timeout_s={serve.startup_timeout_s:g})"
    report_progress("serving", starting)

    def waited(seconds: float) -> None:
        report_progress("serving", starting, int(seconds), int(serve.startup_timeout_s), quiet=True)

    server = start_server(served, serve, name, max_model_len, out_dir / SERVER_LOG, accelerator, waited)
    try:
        log.info("serving %s at %s (up in %.0f s)", served, server.url, time.monotonic() - started)
        report_progress("serving", "greedy parity, quality and load test")
        measured = measure(server, served, data, ours, ours_logprobs, check, out_dir)
    finally:
        server.stop()
    devices = serve.tensor_parallel if accelerator != "cpu" else 1
    checks = judge(measured.load, measured.parity, measured.quality, check.thresholds, devices)
    chain = parity_chain(served, None if quantization_json is None else Path(quantization_json), measured.parity,
                         measured.logprobs, check.thresholds.greedy_match_min, out_dir / SERVING_JSON)  # fmt: skip
    report = ServingReport(
        model_dir=str(served),
        step=served_step,
        url=server.url,
        server_pid=server.pid,
        accelerator=accelerator,
        devices=devices,
        load=measured.load,
        server=measured.server,
        parity=measured.parity,
        logprobs=measured.logprobs,
        quality=measured.quality,
        checks=checks,
        chain=chain,
        per_request_e2e_ms=measured.per_request_e2e_ms,
        files={},
    )
    return write_reports(report, serve, name, out_dir, pod_memory_bytes)


@dataclass(frozen=True)
class Measured:
    """What the serving check measured on a running server."""

    parity: ParityFigures
    logprobs: LogprobFigures
    quality: QualityFigures
    load: LoadFigures
    per_request_e2e_ms: list[float]
    server: ServerFigures


def measure(
    server: Server, model_dir: Path, data: HeldOut, ours: list[list[int]], ours_logprobs: list[list[float]],
    check: ServingCheckConfig, out_dir: Path,
) -> Measured:  # fmt: skip
    """Greedy parity against `ours`, the prompts' log-probabilities against `ours_logprobs`, generation quality
    and the load test, on `server`.

    A server process that exited meanwhile is the finding (ServerExited: its exit code, first error and log),
    whether a request failed because of it or the load generator only counted failed requests."""
    from tasks.serve.load import run_load_test

    during = "the serving check (parity, quality and load test)"
    try:
        served, _ = served_greedy(server, data.prompts[: check.parity_prompts], check.parity_tokens)
        parity = compare_greedy(ours, served, check.parity_tokens)
        served_logprobs = [prompt_logprobs(server, p) for p in data.prompts[: check.parity_prompts]]
        logprobs = logprob_deviation(ours_logprobs, served_logprobs)
        _, predictions = served_greedy(server, data.prompts[: check.quality_prompts], check.output_tokens)
        references = decode(model_dir, data.continuations[: check.quality_prompts])
        quality = score_quality(predictions, references)
        prompts_text = decode(model_dir, data.prompts[: check.num_prompts])
        with MetricsSampler(server.url, check.metrics_interval_s) as sampler:
            load, per_request = run_load_test(server, model_dir, prompts_text, check, out_dir)
        figures = sampler.figures(load.output_tokens)
    except Exception as err:
        exited = server.exited(during, grace_s=_EXIT_GRACE_S)
        if exited is not None:
            raise exited from err
        raise
    exited = server.exited(during)
    if exited is not None:
        raise exited
    return Measured(parity, logprobs, quality, load, per_request, figures)


def decode(model_dir: Path, sequences: list[list[int]]) -> list[str]:
    """Token ids to text with the exported tokenizer (the one the server uses)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in sequences]
