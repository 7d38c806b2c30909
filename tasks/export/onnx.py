"""The export to ONNX Runtime: an exported Hugging Face folder as an ONNX decoder with a KV cache, fp32 and int8.

For CPU and edge inference of the model (an application that embeds ONNX Runtime, a device without Python or
PyTorch), not a second LLM server: vLLM stays the server (continuous batching, paged KV cache).

The graph is `torch.onnx.export(dynamo=True)` of the folder loaded by transformers (fp32, CPU, no remote code),
wrapped so that the cache crosses the boundary as plain tensors, in the layout Optimum's ONNX exports use:
inputs `input_ids` [batch, seq], `attention_mask` [batch, past + seq], `position_ids` [batch, seq] and
`past_key_values.<i>.key|value` [batch, kv_heads, past, head_dim] (past 0 for the prompt); outputs `logits`
[batch, seq, vocab] and `present.<i>.key|value` [batch, kv_heads, past + seq, head_dim]. Optimum's exporter
itself (`optimum-onnx` 0.1.0, the current release) pins transformers < 4.58 and fails to import beside
transformers 5 (`get_parameter_dtype` is gone), hence torch's exporter.

The int8 variant is ONNX Runtime's dynamic quantization (`quantize_dynamic`): int8 weights per output channel in
7 bits (`reduce_range`: no saturation on CPUs without VNNI), activations quantized on the fly per batch; no
calibration data.

Each variant is its own folder (the ONNX graph with its external weights, the Hugging Face folder's config and
tokenizer files, EXPORT.json written last, as the Hugging Face export does) and carries its parity:
- fp32: logits on the held-out prompts against transformers' on the source folder (itself checked against the
  checkpoint at its export, EXPORT.json `parity`), within ONNX_ATOL + ONNX_RTOL * max |logit|; and the cached
  path: the prompt's last DECODE_STEPS tokens fed one at a time through the KV cache give the same logits.
- int8: judged by bounds instead (quantization changes the function on purpose): top-1 agreement with the fp32
  reference on every prompt position, and the largest logit error relative to the largest logit (Int8Bounds).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tasks.errors import UserError
from tasks.export.hf import CONFIG, GENERATION_CONFIG, TOKENIZER, TOKENIZER_CONFIG
from tasks.export.step import EXPORT_RECORD, PARTIAL_PREFIX, export_checkpoint, share_modes
from tasks.results import StepResult
from training.storage import is_local, local_path

if TYPE_CHECKING:
    import numpy as np
    import torch

    from tasks.export.step import ExportInputs, ExportResult
    from training.config import TrainConfig

log = logging.getLogger(__name__)

FORMATS = ("hf", "onnx")
"""`tdeploy export --format`: a Hugging Face folder, or that folder plus its ONNX fp32 and int8 variants."""
ONNX_MODEL = "model.onnx"
ONNX_DATA = "model.onnx.data"
"""The weights beside the graph (ONNX external data): a protobuf file holds at most 2 GB."""
ONNX_RECORD_VERSION = 1
ONNX_SUFFIX = "-onnx"
INT8_SUFFIX = "-int8"
OPSET = 18
COPIED = (CONFIG, GENERATION_CONFIG, TOKENIZER, TOKENIZER_CONFIG)
"""Files of the Hugging Face folder each ONNX folder carries: a consumer needs the tokenizer and the shapes."""
# ONNX Runtime against PyTorch, both fp32: the same operations in another order and with other kernels; measured
# at 1e-7..3e-7 on the test models' logits (the Hugging Face export's own check, tasks/export/parity.py, allows
# 1e-4 + 1e-3 * max |logit| for the same reason). A wrong graph (a lost mask, a wrong cache position) moves the
# logits by 1e-2 and more.
ONNX_ATOL = 1e-4
ONNX_RTOL = 1e-3
DECODE_STEPS = 4
"""Tokens of each prompt fed one at a time through the KV cache (the path generation takes)."""


class OnnxExportError(UserError):
    """An ONNX export that cannot be made or does not reproduce its source; nothing is published."""


class Int8Bounds(BaseModel):
    """How far the int8 variant may move from fp32 (quantization changes the function on purpose).

    Measured with per-channel int8 weights on random-initialised test models (the hardest case: their logits are
    nearly flat, so a small error flips the top token): d_model 64 top-1 0.984, relative error 0.013; d_model 256
    top-1 0.953, relative error 0.030. A wrong scale (x2 on one weight) gives relative errors of 0.5 and more.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    min_top1_agreement: float = Field(
        0.9,
        ge=0.0,
        le=1.0,
        description="Least fraction of prompt positions where int8's most likely next token is fp32's.",
    )
    max_rel_logit_error: float = Field(
        0.1,
        gt=0.0,
        description="Largest |int8 - fp32| logit over the largest |fp32 logit| (the prompts' positions).",
    )


class OnnxParity(BaseModel):
    """One ONNX variant against its reference: what was compared, the deviations and the verdict."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    precision: Literal["fp32", "int8"]
    reference: str
    """What the logits were compared with: transformers (fp32) on the source folder."""
    prompts: int
    prompt_tokens: int
    prompts_from: str
    max_abs_logit_diff: float
    max_abs_logit: float
    """The reference's largest |logit|: the scale the tolerances are relative to."""
    top1_agreement: float
    """Fraction of prompt positions where the variant's most likely next token is the reference's."""
    tolerance: float | None = None
    """fp32: the largest |logit difference| allowed (ONNX_ATOL + ONNX_RTOL * max_abs_logit)."""
    decode_max_abs_logit_diff: float | None = None
    """fp32: the same logits through the KV cache, one token at a time (DECODE_STEPS per prompt)."""
    bounds: Int8Bounds | None = None
    """int8: the bounds it is judged by."""
    upstream_max_abs_logit_diff: float | None = None
    """The source folder's own deviation from the checkpoint (its EXPORT.json parity), when it records one."""
    upstream_tolerance: float | None = None

    @property
    def max_rel_logit_error(self) -> float:
        """max_abs_logit_diff over max_abs_logit."""
        return self.max_abs_logit_diff / max(self.max_abs_logit, 1e-30)

    def problems(self) -> list[str]:
        """What is out of bounds ([] when the variant passes)."""
        found = []
        if self.precision == "fp32":
            assert self.tolerance is not None
            if not self.max_abs_logit_diff <= self.tolerance:
                found.append(f"max |logit diff| {self.max_abs_logit_diff:.4g} > tolerance {self.tolerance:.2g}")
            decode = self.decode_max_abs_logit_diff
            if decode is not None and not decode <= self.tolerance:
                found.append(f"through the KV cache: max |logit diff| {decode:.4g} > tolerance {self.tolerance:.2g}")
            return found
        assert self.bounds is not None
        if not self.top1_agreement >= self.bounds.min_top1_agreement:
            found.append(f"top-1 agreement {self.top1_agreement:.3f} < {self.bounds.min_top1_agreement}")
        if not self.max_rel_logit_error <= self.bounds.max_rel_logit_error:
            found.append(
                f"max |logit error| / max |logit| {self.max_rel_logit_error:.4g} > {self.bounds.max_rel_logit_error}"
            )
        return found

    @property
    def passed(self) -> bool:
        """Within the tolerance (fp32) or the bounds (int8)."""
        return not self.problems()

    def describe(self) -> str:
        """The deviation and what it was judged by, in one line."""
        if self.precision == "fp32":
            decode = self.decode_max_abs_logit_diff
            cached = f", through the KV cache {decode:.3g}" if decode is not None else ""
            return f"max |logit diff| {self.max_abs_logit_diff:.3g}{cached} (tolerance {self.tolerance:.2g})"
        assert self.bounds is not None
        return (
            f"top-1 agreement {self.top1_agreement:.3f} (at least {self.bounds.min_top1_agreement}), max |logit "
            f"error| / max |logit| {self.max_rel_logit_error:.3g} (at most {self.bounds.max_rel_logit_error})"
        )


class OnnxVariant(BaseModel):
    """One ONNX folder that was written: where, which precision, its files and its parity."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model_dir: str
    precision: Literal["fp32", "int8"]
    files: list[str]
    bytes: int
    """Bytes of the graph and its weights (model.onnx and model.onnx.data)."""
    parity: OnnxParity


class OnnxExportResult(StepResult):
    """A Hugging Face folder exported to ONNX Runtime: the fp32 and int8 folders."""

    source_dir: str
    """The Hugging Face folder the graphs were exported from."""
    step: int | None = None
    """The checkpoint step, when the source folder records it."""
    variants: list[OnnxVariant]

    def summary(self) -> str:
        """Each variant's folder, size and deviation."""
        parts = [
            f"{v.precision} {v.bytes / 1e6:.1f} MB in `{v.model_dir}` (max |logit diff| "
            f"{v.parity.max_abs_logit_diff:.3g}, top-1 {v.parity.top1_agreement:.3f})"
            for v in self.variants
        ]
        return f"ONNX of `{self.source_dir}`: " + "; ".join(parts)


def check_format(value: str) -> str:
    """`value` when it is one of FORMATS; UserError naming it otherwise."""
    if value not in FORMATS:
        raise UserError(
            f"--format={value}: not an export format", f"use one of {', '.join(FORMATS)} (hf: the default)"
        )
    return value


def onnx_dirs(hf_dir: str, out: str | None = None) -> tuple[Path, Path]:
    """The fp32 and int8 folders: `out` and `out`-int8, else beside the Hugging Face folder (<hf_dir>-onnx and
    <hf_dir>-onnx-int8). Local folders only (ONNX Runtime reads files)."""
    base = out if out is not None else hf_dir.rstrip("/") + ONNX_SUFFIX
    if not is_local(base):
        raise UserError(
            f"out={base}: an ONNX export is written to a local folder (ONNX Runtime loads files)",
            "pass --out with a local folder, or export the Hugging Face folder to a local one",
        )
    fp32 = Path(local_path(base))
    return fp32, fp32.with_name(fp32.name + INT8_SUFFIX)


def _require_runtime() -> None:
    """OnnxExportError naming the extra when onnx, onnxscript or onnxruntime is not installed."""
    missing = []
    for module in ("onnx", "onnxscript", "onnxruntime"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise OnnxExportError(
            f"--format=onnx: {', '.join(missing)} not installed",
            "pip install 'transformer-deploy[onnx]' (onnx, onnxscript, onnxruntime)",
        )


def _load_hf(folder: Path) -> Any:
    """The folder as transformers loads it for inference: fp32, CPU, eval, no remote code."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, trust_remote_code=False, device_map=None
    ).eval()


def io_names(n_layers: int) -> tuple[list[str], list[str]]:
    """The graph's input and output names for a model of `n_layers` layers (Optimum's names)."""
    cache = [f"{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]
    inputs = ["input_ids", "attention_mask", "position_ids", *(f"past_key_values.{name}" for name in cache)]
    outputs = ["logits", *(f"present.{name}" for name in cache)]
    return inputs, outputs


def cache_argument(model: Any) -> str:
    """The name transformers' forward takes the KV cache by: `cache` (5.24 and later; `past_key_values` is
    deprecated there and goes in 5.40) or `past_key_values` (before)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(out: Any) -> Any:
    """The KV cache a transformers forward returned (`cache`, or `past_key_values` before 5.24)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _decoder_with_cache(model: Any) -> torch.nn.Module:
    """`model` with its KV cache as flat tensors in and out (what an ONNX graph can carry)."""
    import torch
    from transformers import DynamicCache

    n_layers = model.config.num_hidden_layers

    class DecoderWithCache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            position_ids: torch.Tensor,
            past: list[torch.Tensor],
        ) -> tuple[torch.Tensor, ...]:
            cache = DynamicCache(config=self.model.config)
            for layer in range(n_layers):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **{cache_argument(self.model): cache},
            )
            present = [t for layer in returned_cache(out).layers for t in (layer.keys, layer.values)]
            return (out.logits, *present)

    return DecoderWithCache().eval()


def _cache_shape(config: Any) -> tuple[int, int]:
    """(kv_heads, head_dim) of a transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return getattr(config, "num_key_value_heads", None) or heads, head_dim


def export_graph(model: Any, folder: Path) -> list[str]:
    """Write `model` (transformers, fp32) as ONNX_MODEL + ONNX_DATA into `folder`; the files written."""
    import torch

    config = model.config
    if getattr(config, "num_local_experts", None):
        raise OnnxExportError(
            f"architecture={config.architectures[0]}: the ONNX export covers dense (Llama) models; transformers 5 "
            "runs MoE experts through its custom op transformers::grouped_mm_fallback, for which torch.onnx has no "
            "ONNX function (the export fails with a DispatchError)",
            "serve MoE models with vLLM (tdeploy serve); export a dense model to ONNX",
        )
    n_layers = config.num_hidden_layers
    kv_heads, head_dim = _cache_shape(config)
    batch, seq, past = 2, 3, 4  # example shapes: distinct so that the exporter keeps each dimension apart
    ids = torch.zeros(batch, seq, dtype=torch.long)
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    positions = torch.arange(past, past + seq).expand(batch, seq)
    cache = [torch.zeros(batch, kv_heads, past, head_dim) for _ in range(2 * n_layers)]
    limit = config.max_position_embeddings
    b = torch.export.Dim("batch", max=1024)
    s = torch.export.Dim("sequence", max=limit)
    p = torch.export.Dim("past_sequence", max=limit)
    t = torch.export.Dim("total_sequence", max=2 * limit)
    inputs, outputs = io_names(n_layers)
    with warnings.catch_warnings(), _quiet_exporter():
        warnings.simplefilter("ignore")  # the exporter's notes on merged dimension names and deprecated pytrees
        torch.onnx.export(
            _decoder_with_cache(model),
            (ids, mask, positions, cache),
            str(folder / ONNX_MODEL),
            dynamo=True,
            external_data=True,
            opset_version=OPSET,
            input_names=inputs,
            output_names=outputs,
            dynamic_shapes=({0: b, 1: s}, {0: b, 1: t}, {0: b, 1: s}, [{0: b, 2: p}] * (2 * n_layers)),
        )
    return [ONNX_MODEL, ONNX_DATA] if (folder / ONNX_DATA).exists() else [ONNX_MODEL]


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """torch.onnx's progress lines go to the log at DEBUG, not to stdout; its notes on operators of packages not
    installed (torchvision's) are dropped."""
    import io
    from contextlib import redirect_stdout

    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    captured = io.StringIO()
    try:
        with redirect_stdout(captured):
            yield
    finally:
        exporter_log.setLevel(level)
    for line in captured.getvalue().splitlines():
        log.debug("torch.onnx: %s", line)


def quantize_int8(fp32_dir: Path, folder: Path) -> list[str]:
    """ONNX Runtime's dynamic int8 quantization of `fp32_dir`'s graph into `folder`; the files written."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    source = fp32_dir / ONNX_MODEL
    big = sum(f.stat().st_size for f in fp32_dir.glob(ONNX_MODEL + "*")) > 1 << 30
    quant_log = logging.getLogger()  # quantize_dynamic warns through the root logger about pre-processing
    level = quant_log.level
    quant_log.setLevel(logging.ERROR)
    try:
        quantize_dynamic(
            source,
            folder / ONNX_MODEL,
            weight_type=QuantType.QInt8,
            per_channel=True,
            # 7-bit weights: ONNX Runtime's u8s8 integer matmul on x86 CPUs without VNNI (AVX2 only, e.g. this
            # project's AMD EPYC test machines) adds pairs of products in saturating 16-bit lanes; with full 8-bit
            # weights a tiny model's logits came out 0.28 of their range off. The graph runs on whatever CPU the
            # deployment has, so it is made safe for all of them.
            reduce_range=True,
            use_external_data_format=big,
        )
    finally:
        quant_log.setLevel(level)
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(ONNX_MODEL))


class OnnxCausalLM:
    """An exported ONNX decoder in ONNX Runtime: full-sequence logits, cached decoding, greedy generation."""

    def __init__(self, folder: str | Path, threads: int = 1) -> None:
        import onnxruntime as ort

        folder = Path(folder)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(folder / ONNX_MODEL), options, providers=["CPUExecutionProvider"])
        config = json.loads((folder / CONFIG).read_text())
        self.n_layers = config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads") or heads
        self.head_dim = config.get("head_dim") or config["hidden_size"] // heads
        self.inputs, self.outputs = io_names(self.n_layers)

    def empty_cache(self, batch: int) -> list[np.ndarray]:
        """A cache of length 0 for `batch` sequences."""
        import numpy as np

        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32) for _ in range(2 * self.n_layers)]

    def step(
        self, ids: np.ndarray, cache: list[np.ndarray], mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits of `ids` [batch, seq] after `cache` (positions continue from it) and the cache after them.
        `mask` [batch, past + seq]: 0 for left padding (positions count the unmasked tokens); all ones if None."""
        import numpy as np

        batch, seq = ids.shape
        past = cache[0].shape[2]
        if mask is None:
            mask = np.ones((batch, past + seq), np.int64)
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, past:]
        feeds = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64),
                 "position_ids": positions.astype(np.int64)}  # fmt: skip
        feeds.update(zip(self.inputs[3:], cache, strict=True))
        logits, *present = self.session.run(self.outputs, feeds)
        return logits, present

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Logits of every position of `ids` [batch, seq] from an empty cache."""
        return self.step(ids, self.empty_cache(ids.shape[0]))[0]

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """`new_tokens` greedy tokens after `prompt`, through the KV cache."""
        import numpy as np

        logits, cache = self.step(np.array([prompt], np.int64), self.empty_cache(1))
        out: list[int] = []
        while True:
            out.append(int(logits[0, -1].argmax()))
            if len(out) == new_tokens:
                return out
            logits, cache = self.step(np.array([[out[-1]]], np.int64), cache)


def _reference_logits(model: Any, prompts: list[list[int]]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(prompts, dtype=torch.long)).logits.float().numpy()


def _decode_deviation(runtime: OnnxCausalLM, prompts: list[list[int]], reference: np.ndarray) -> float:
    """Largest |logit difference| when each prompt's last DECODE_STEPS tokens go through the cache one by one."""
    import numpy as np

    ids = np.array(prompts, np.int64)
    split = max(1, ids.shape[1] - DECODE_STEPS)
    logits, cache = runtime.step(ids[:, :split], runtime.empty_cache(ids.shape[0]))
    worst = float(np.abs(logits - reference[:, :split]).max())
    for pos in range(split, ids.shape[1]):
        logits, cache = runtime.step(ids[:, pos : pos + 1], cache)
        worst = max(worst, float(np.abs(logits[:, 0] - reference[:, pos]).max()))
    return worst


def measure_parity(
    folder: Path,
    precision: Literal["fp32", "int8"],
    prompts: list[list[int]],
    prompts_from: str,
    reference: np.ndarray,
    reference_name: str,
    bounds: Int8Bounds,
    upstream: dict[str, Any] | None = None,
) -> OnnxParity:
    """The ONNX graph in `folder` against `reference` logits of `prompts`; the finding, not yet judged."""
    import numpy as np

    runtime = OnnxCausalLM(folder)
    ids = np.array(prompts, np.int64)
    logits = runtime.logits(ids)
    scale = float(np.abs(reference).max())
    fields: dict[str, Any] = {
        "precision": precision,
        "reference": reference_name,
        "prompts": len(prompts),
        "prompt_tokens": ids.shape[1],
        "prompts_from": prompts_from,
        "max_abs_logit_diff": float(np.abs(logits - reference).max()),
        "max_abs_logit": scale,
        "top1_agreement": float((logits.argmax(-1) == reference.argmax(-1)).mean()),
        "upstream_max_abs_logit_diff": (upstream or {}).get("max_abs_logit_diff"),
        "upstream_tolerance": (upstream or {}).get("tolerance"),
    }
    if precision == "fp32":
        fields["tolerance"] = ONNX_ATOL + ONNX_RTOL * scale
        fields["decode_max_abs_logit_diff"] = _decode_deviation(runtime, prompts, reference)
    else:
        fields["bounds"] = bounds
    return OnnxParity(**fields)


def require_onnx_parity(parity: OnnxParity, folder: str) -> None:
    """OnnxExportError naming what is out of bounds unless `parity` passed."""
    problems = parity.problems()
    if not problems:
        return
    raise OnnxExportError(
        f"ONNX {parity.precision} parity failed for {folder}: " + "; ".join(problems)
        + f" ({parity.prompts} prompts of {parity.prompt_tokens} tokens from {parity.prompts_from}, against "
        f"{parity.reference})",
        "nothing was published (neither variant); fp32: the exported graph does not compute the model, report it "
        "with the Hugging Face folder; int8: this model loses more than the bounds allow when quantized, pass looser "
        "Int8Bounds (export_onnx's bounds) only if the measured loss is acceptable",
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_source_record(hf_dir: Path) -> dict[str, Any]:
    """The source folder's EXPORT.json (tasks/export/step.py), or {} for a folder exported elsewhere."""
    path = hf_dir / EXPORT_RECORD
    return json.loads(path.read_text()) if path.exists() else {}


def _write_record(folder: Path, files: list[str], parity: OnnxParity, hf_dir: Path, source: dict[str, Any]) -> None:
    """EXPORT.json of an ONNX folder: source, graph I/O, runtime versions, parity and file checksums (last)."""
    import onnxruntime
    import torch

    inputs, outputs = io_names(json.loads((folder / CONFIG).read_text())["num_hidden_layers"])
    record = {
        "format_version": ONNX_RECORD_VERSION,
        "format": "onnx",
        "precision": parity.precision,
        "source": {
            "model_dir": str(hf_dir),
            "export_record_sha256": _sha256(hf_dir / EXPORT_RECORD) if (hf_dir / EXPORT_RECORD).exists() else None,
            "checkpoint_url": (source.get("source") or {}).get("checkpoint_url"),
            "step": (source.get("source") or {}).get("step"),
        },
        "graph": {"file": ONNX_MODEL, "opset": OPSET, "inputs": inputs, "outputs": outputs},
        "exporter": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
        "parity": parity.model_dump(mode="json"),
        "exported_unix_s": time.time(),
        "files": {name: {"sha256": _sha256(folder / name), "bytes": (folder / name).stat().st_size} for name in files},
    }
    (folder / EXPORT_RECORD).write_text(json.dumps(record, indent=2))


def _check_target(final: Path) -> None:
    if final.exists() and (not final.is_dir() or (any(final.iterdir()) and not (final / EXPORT_RECORD).exists())):
        raise UserError(
            f"out={final}: exists and is not an export (no {EXPORT_RECORD}); an export replaces only an earlier one",
            "remove it, or choose another output folder",
        )


def _publish(partial: Path, final: Path) -> None:
    """Put the finished `partial` folder in place of `final` (an earlier export there goes)."""
    share_modes(partial)
    if final.exists():
        old = final.with_name(f"{PARTIAL_PREFIX}old-{final.name}-{time.time_ns()}")
        final.rename(old)
        partial.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        partial.rename(final)


def export_onnx(
    hf_dir: str | Path,
    prompts: list[list[int]],
    prompts_from: str,
    out: str | None = None,
    *,
    bounds: Int8Bounds | None = None,
    int8: bool = True,
) -> OnnxExportResult:
    """Export the Hugging Face folder `hf_dir` to ONNX (fp32, and int8 unless `int8` is False) with the parity of
    each against transformers' logits of `prompts` (OnnxExportError when one is out of bounds: nothing published).

    `out`: the fp32 folder (int8: `out`-int8); None: beside `hf_dir` (see `onnx_dirs`).
    """
    _require_runtime()
    bounds = bounds or Int8Bounds()
    hf_dir = Path(hf_dir)
    fp32_dir, int8_dir = onnx_dirs(str(hf_dir), out)
    targets = [fp32_dir, int8_dir] if int8 else [fp32_dir]
    for target in targets:
        _check_target(target)
        target.parent.mkdir(parents=True, exist_ok=True)
    source = read_source_record(hf_dir)
    upstream = source.get("parity")
    model = _load_hf(hf_dir)
    reference = _reference_logits(model, prompts)
    name = f"transformers fp32 of {hf_dir}"
    partials = [Path(tempfile.mkdtemp(prefix=f"{PARTIAL_PREFIX}{t.name}-", dir=t.parent)) for t in targets]
    try:
        for partial in partials:
            for copied in COPIED:
                if (hf_dir / copied).exists():
                    shutil.copyfile(hf_dir / copied, partial / copied)
        started = time.monotonic()
        graph_files = export_graph(model, partials[0])
        del model
        log.info("ONNX graph of %s exported in %.1f s", hf_dir, time.monotonic() - started)
        variants = []
        for precision, partial, final in zip(("fp32", "int8"), partials, targets, strict=False):
            if precision == "int8":
                graph_files = quantize_int8(partials[0], partial)
            parity = measure_parity(partial, precision, prompts, prompts_from, reference, name, bounds, upstream)
            require_onnx_parity(parity, str(final))
            files = [*graph_files, *(c for c in COPIED if (partial / c).exists())]
            _write_record(partial, files, parity, hf_dir, source)
            size = sum((partial / f).stat().st_size for f in graph_files)
            variants.append(
                OnnxVariant(model_dir=str(final), precision=precision, files=[*files, EXPORT_RECORD], bytes=size,
                            parity=parity)  # fmt: skip
            )
        for partial, final in zip(partials, targets, strict=True):
            _publish(partial, final)
    finally:
        for partial in partials:
            shutil.rmtree(partial, ignore_errors=True)
    result = OnnxExportResult(source_dir=str(hf_dir), step=(source.get("source") or {}).get("step"), variants=variants)
    log.info("exported %s", result.summary())
    return result


def export_checkpoint_onnx(
    train: TrainConfig,
    step: int | None = None,
    out: str | None = None,
    *,
    hf_out: str | None = None,
    export_root: str | None = None,
    tokenizer_url: str | None = None,
    bounds: Int8Bounds | None = None,
) -> tuple[ExportResult, OnnxExportResult]:
    """`tdeploy export --format onnx`: the checkpoint through the Hugging Face export (with its own parity against
    the checkpoint) to `hf_out` (default <export_root>/step-<N>), then that folder to ONNX (`out`, default beside
    it: step-<N>-onnx and step-<N>-onnx-int8) with its parity on the same held-out prompts; the ExportResult and
    the OnnxExportResult."""
    from tasks.export.parity import parity_prompts

    _require_runtime()
    if out is not None:
        onnx_dirs(out, out)  # a non-local --out is refused before the Hugging Face export runs
    exported = export_checkpoint(train, step, hf_out, export_root=export_root, tokenizer_url=tokenizer_url)
    if not is_local(exported.model_dir):
        raise OnnxExportError(
            f"model_dir={exported.model_dir}: the ONNX export reads a local Hugging Face folder",
            "export with a local export folder (deployment_dir on a local or mounted file system)",
        )
    config = json.loads(Path(local_path(exported.model_dir)).joinpath(CONFIG).read_text())
    prompts, prompts_from = parity_prompts(train, config["vocab_size"], config["max_position_embeddings"])
    result = export_onnx(local_path(exported.model_dir), prompts, prompts_from, out, bounds=bounds)
    return exported, result


def run_onnx(inputs: ExportInputs, out: str | None = None) -> tuple[ExportResult, OnnxExportResult]:
    """The export step's checkpoint (`inputs`; its `out` is the Hugging Face folder) exported to ONNX in `out`
    (see `export_checkpoint_onnx`)."""
    return export_checkpoint_onnx(
        inputs.train, inputs.step, out, hf_out=inputs.out, export_root=inputs.export_root,
        tokenizer_url=inputs.tokenizer_url,
    )  # fmt: skip
