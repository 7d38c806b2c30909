"""A Hugging Face checkpoint (`model.init_from`) as the payload's starting weights, and the check that they load.

What is read: config.json, validated here (`read_hf_config`): a Llama, Mistral or Mixtral model whose every
function-changing field our Transformer (training/model.py) computes the same way. What it cannot represent is
refused with the field: another rope scaling, biases, another activation, a head_dim other than hidden/heads, a
sliding window shorter than the sequence, custom code (`auto_map`: trust_remote_code is never enabled),
quantized weights. Weights come from *.safetensors only (plain data); a folder of pickle .bin / .pt files is
refused, since unpickling them runs whatever code they name.

How it is read (`load_hf_state`, `load_into`): by tensor, under our names (training/hf_names.py), cast to fp32.
A rank reads only the tensors it holds (a pipeline stage its layers), and of a tensor sharded by tensor
parallelism or FSDP only its own slice: from a local folder through safetensors' memory-mapped `get_slice`
(nothing else of the file is read); from an object store by byte range of that tensor (then sliced in memory).

The load check (`check_init`): the pipeline writes transformers' fp32 logits of the checkpoint on a fixed prompt
(`init_check.json`, `write_init_check`); the job, after loading under its layout (DDP, FSDP, TP, PP), computes
its own on the same prompt and refuses to start (`InitCheckError`, a workload error: not retried) when the largest
deviation exceeds INIT_CHECK_RTOL x the largest |logit| (at least INIT_CHECK_RTOL absolute).
"""

from __future__ import annotations

import base64
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.config import ModelConfig
from training.hf_config import HFLoadError, TensorEntry, tensor_index, unmapped_tensors
from training.hf_names import hf_name
from training.storage import StorageConfig, filesystem, is_local, join, local_path, write_bytes_atomic

log = logging.getLogger(__name__)

HF_INIT_CHECK = "init_check.json"
INIT_CHECK_VERSION = 1
INIT_CHECK_RTOL = 1e-3
"""The load check's tolerance, relative to the largest |logit| of transformers' (and at least this, absolute).
Both sides compute in fp32 on the same weights; they differ by summation order only (SDPA against transformers'
attention, TP's sharded matmuls): on a 2-layer Llama with logits up to 5.1, 0 under DDP, FSDP and PP2 and 2.6e-6
under TP2 (5e-7 of the largest logit); deeper models add rounding per layer. What the check is for is orders
larger: on that model k_proj / v_proj swapped moved the logits by 6.2, rope_theta 10000 for 5000 by 0.53."""
PROMPT_TOKENS = 16

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
}  # fmt: skip


class InitCheckError(ValueError):
    """The weights this job loaded do not compute what transformers computes from the same checkpoint."""

    def __init__(self, source: str, deviation: float, tolerance: float, fix: str) -> None:
        super().__init__(
            f"model.init_from={source}: the job's logits on the check prompt deviate from transformers' by up to "
            f"{deviation:.3g} (tolerance {tolerance:.3g}); {fix}"
        )
        self.source, self.deviation, self.tolerance, self.fix = source, deviation, tolerance, fix


def expected_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes for `model` (tied weights once), built on the meta device."""
    from training.model import Transformer  # noqa: PLC0415 - model imports config only; kept light for tasks

    with torch.device("meta"):
        built = Transformer(model)
    return {name: tuple(param.shape) for name, param in built.named_parameters()}


def _source_name(ours: str, model: ModelConfig, index: Mapping[str, TensorEntry]) -> str:
    """The checkpoint tensor our parameter `ours` is read from (a tied lm_head reads the embedding)."""
    theirs = hf_name(ours, model.tie_embeddings) or "model.embed_tokens.weight"
    if theirs not in index:
        raise HFLoadError(
            "model.init_from tensor", theirs, f"missing: the model needs it for {ours}",
            "check that config.json and the weights belong together (num_hidden_layers, tie_word_embeddings)",
        )  # fmt: skip
    return theirs


def _read(url: str, storage: StorageConfig | None, entry: TensorEntry, name: str,
          part: tuple[slice, ...] | None) -> torch.Tensor:  # fmt: skip
    """Tensor `name` (or its `part`) as fp32: memory-mapped slices from a local file, a byte range from a store."""
    if entry.dtype not in _DTYPES:
        raise HFLoadError(f"model.init_from tensor {name}", entry.dtype, "is not a floating dtype the payload reads",
                          "start from an unquantized fp32, bf16 or fp16 checkpoint")  # fmt: skip
    if is_local(url):
        from safetensors import safe_open  # noqa: PLC0415 - read by the payload only with model.init_from

        with safe_open(join(local_path(url), entry.file), framework="pt") as handle:
            tensor = handle.get_slice(name)[part] if part else handle.get_tensor(name)
        return tensor.to(torch.float32).contiguous()
    fs, root = filesystem(url, storage)
    raw = fs.cat_file(join(root, entry.file), start=entry.start, end=entry.end)
    tensor = torch.frombuffer(bytearray(raw), dtype=_DTYPES[entry.dtype]).reshape(entry.shape)
    return (tensor[part] if part else tensor).to(torch.float32).contiguous()


def load_hf_state(
    url: str,
    model: ModelConfig,
    *,
    names: Iterable[str] | None = None,
    parts: Mapping[str, tuple[slice, ...]] | None = None,
    storage: StorageConfig | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under our names, fp32: all of `model`'s parameters or only `names`, each whole or
    its `parts[name]` slice (HFLoadError for a missing, extra or misshapen tensor)."""
    index = tensor_index(url, storage)
    unknown = unmapped_tensors(index)
    if unknown:
        raise HFLoadError("model.init_from tensor", unknown[0], f"has no place in the payload's Transformer "
                          f"({len(unknown)} such tensors: biases, fused experts or another architecture)",
                          "start from a Llama, Mistral or Mixtral checkpoint as transformers saves it")  # fmt: skip
    shapes = expected_shapes(model)
    wanted = list(shapes) if names is None else list(names)
    state = {}
    for ours in wanted:
        if ours not in shapes:
            raise HFLoadError("parameter", ours, "is not one of the model's", "ask for training/model.py's names")
        theirs = _source_name(ours, model, index)
        entry = index[theirs]
        if entry.shape != shapes[ours]:
            raise HFLoadError(f"model.init_from tensor {theirs}", list(entry.shape),
                              f"the model config gives {ours} the shape {list(shapes[ours])}",
                              "state the checkpoint's architecture (or leave the fields out to read them from "
                              "config.json)")  # fmt: skip
        state[ours] = _read(url, storage, entry, theirs, (parts or {}).get(ours))
    return state


def _plain_name(name: str) -> str:
    """A parameter name without the wrappers' prefixes (DDP's module., compile's _orig_mod., checkpointing's)."""
    for prefix in ("module.", "_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def _local_part(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """The tensor this rank holds of `param` and which slice of the whole parameter it is (None: all of it)."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    if not isinstance(param, DTensor):
        return param, None
    # torch has no public "which slice of the global tensor is mine"; DTensor's own helper answers it for every
    # placement (FSDP2's dim-0 shards, TP's row and column shards).
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: PLC0415

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


@torch.no_grad()
def load_into(module: nn.Module, url: str, model: ModelConfig, storage: StorageConfig | None = None) -> int:
    """Copy the checkpoint's weights into `module` (a whole model, DDP- or FSDP-wrapped, TP-sharded, or a pipeline
    rank's stage): each rank reads only the parameters it holds, and of each only its own slice. The count."""
    targets: dict[str, tuple[torch.Tensor, tuple[slice, ...] | None]] = {}
    for name, param in module.named_parameters():
        targets[_plain_name(name)] = _local_part(param)
    parts = {name: part for name, (_, part) in targets.items() if part is not None}
    state = load_hf_state(url, model, names=list(targets), parts=parts, storage=storage)
    for name, (local, _) in targets.items():
        local.copy_(state.pop(name).to(local.device))
    return len(targets)


# ---- the load check --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InitCheck:
    """init_check.json: transformers' fp32 logits of `source` on `prompt_ids` (shape len(prompt_ids) x vocab)."""

    source: str
    prompt_ids: list[int]
    logits: torch.Tensor
    transformers_version: str


def check_prompt(vocab_size: int, seq_len: int) -> list[int]:
    """The fixed prompt of the load check: PROMPT_TOKENS ids spread over the vocabulary (fewer if seq_len is)."""
    return [(1 + 7919 * i) % vocab_size for i in range(min(PROMPT_TOKENS, seq_len))]


def write_init_check(url: str, check: InitCheck, storage: StorageConfig | None = None) -> None:
    """Write `check` to `url` (a file URL), atomically."""
    logits = check.logits.detach().to(torch.float32).contiguous()
    doc = {
        "format_version": INIT_CHECK_VERSION,
        "source": check.source,
        "prompt_ids": check.prompt_ids,
        "shape": list(logits.shape),
        "logits_f32_base64": base64.b64encode(logits.numpy().astype("<f4").tobytes()).decode("ascii"),
        "transformers_version": check.transformers_version,
    }
    fs, path = filesystem(url, storage)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    write_bytes_atomic(fs, path, json.dumps(doc).encode())


def read_init_check(url: str, storage: StorageConfig | None = None) -> InitCheck:
    """The InitCheck at `url` (ValueError naming the file when it is not what `write_init_check` writes)."""
    fs, path = filesystem(url, storage)
    try:
        doc = json.loads(fs.cat_file(path))
        if doc.get("format_version") != INIT_CHECK_VERSION:
            raise ValueError(f"format_version {doc.get('format_version')}, this reader knows {INIT_CHECK_VERSION}")
        shape = tuple(int(n) for n in doc["shape"])
        prompt = [int(i) for i in doc["prompt_ids"]]
        raw = base64.b64decode(doc["logits_f32_base64"], validate=True)
        logits = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)
    except (ValueError, KeyError, TypeError, RuntimeError) as err:  # JSON, base64 and a shape that does not fit
        problem = f"{url}: not an init check record ({err}); the pipeline writes it again on the next run"
        raise ValueError(problem) from err
    if len(shape) != 2 or shape[0] != len(prompt):
        raise ValueError(f"{url}: logits of shape {list(shape)} for a prompt of {len(prompt)} tokens")
    return InitCheck(doc["source"], prompt, logits, doc.get("transformers_version", ""))


def tolerance(reference: torch.Tensor) -> float:
    """The load check's bound for logits `reference` (INIT_CHECK_RTOL)."""
    return INIT_CHECK_RTOL * max(1.0, float(reference.abs().max()))


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _pipeline_logits(pipeline: Any, meshes: Any, n_chunks: int, prompt: torch.Tensor) -> torch.Tensor | None:
    """Logits of `prompt` through the pipeline's chunks in order, hidden states sent stage to stage (the last
    chunk's ranks get them; None elsewhere)."""
    pp, me = meshes.dims.pp, meshes.coords["pp"]
    group = meshes.pp.get_group()
    held = dict(zip(range(me, n_chunks, pp), pipeline.chunks, strict=True))
    x: torch.Tensor | None = prompt
    for index in range(n_chunks):
        owner = index % pp
        if owner != me:
            continue
        if index > 0:
            shape = torch.zeros(3, dtype=torch.int64)
            dist.recv(shape, group=group, group_src=(index - 1) % pp)
            x = torch.empty(tuple(shape.tolist()), dtype=torch.float32, device=prompt.device)
            dist.recv(x, group=group, group_src=(index - 1) % pp)
        out = held[index](x)
        out = out[0] if isinstance(out, tuple) else out
        if index == n_chunks - 1:
            return _full(out)
        local = out.to_local() if hasattr(out, "to_local") else out
        local = local.detach().float().contiguous()
        dist.send(torch.tensor(local.shape, dtype=torch.int64), group=group, group_dst=(index + 1) % pp)
        dist.send(local, group=group, group_dst=(index + 1) % pp)
    return None


@torch.no_grad()
def layout_logits(
    model: nn.Module, pipeline: Any, meshes: Any, n_chunks: int, prompt: torch.Tensor
) -> torch.Tensor | None:
    """This job's fp32 logits of `prompt` (1, T) under its layout (None on ranks without the last pipeline chunk)."""
    modules = pipeline.chunks if pipeline is not None else [model]
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        if pipeline is not None:
            return _pipeline_logits(pipeline, meshes, n_chunks, prompt)
        logits = model(prompt)
        return _full(logits[0] if isinstance(logits, tuple) else logits)
    finally:
        for m, mode in zip(modules, modes, strict=True):
            m.train(mode)


def verdict(check: InitCheck, logits: torch.Tensor | None, device: torch.device) -> tuple[float, float]:
    """The largest deviation of any rank's logits from the check's, agreed by every rank (collective), and the
    tolerance."""
    deviation = 0.0
    if logits is not None:
        diff = (logits.reshape(check.logits.shape).float().cpu() - check.logits).abs().max().item()
        deviation = math.inf if not math.isfinite(diff) else diff
    agreed = torch.tensor([deviation], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return float(agreed.item()), tolerance(check.logits)


def initialise(
    module: nn.Module,
    pipeline: Any,
    meshes: Any,
    model: ModelConfig,
    n_chunks: int,
    check_url: str | None,
    device: torch.device,
    storage: StorageConfig | None = None,
) -> float | None:
    """Load model.init_from into this rank's part of the model, then (with `check_url`) check the job's logits
    against transformers'; the deviation, or None unchecked. InitCheckError (every rank) when beyond tolerance."""
    assert model.init_from is not None
    count = load_into(module, model.init_from, model, storage)
    log.info("loaded %d parameters from %s", count, model.init_from)
    if check_url is None:
        return None
    check = read_init_check(check_url, storage)
    if max(check.prompt_ids) >= model.vocab_size or len(check.prompt_ids) > model.seq_len:
        raise ValueError(
            f"{check_url}: its prompt does not fit model.vocab_size / seq_len; the pipeline writes it again"
        )
    prompt = torch.tensor([check.prompt_ids], dtype=torch.long, device=device)
    deviation, bound = verdict(check, layout_logits(module, pipeline, meshes, n_chunks, prompt), device)
    if not deviation <= bound:
        raise InitCheckError(
            model.init_from, deviation, bound,
            "the weights were not loaded as transformers reads them: check that the spec's model fields agree with "
            "config.json (leave them out to take config.json's), or report the layout that loaded them wrong",
        )  # fmt: skip
    log.info("init check: logits within %.3g of transformers' (largest deviation %.3g)", bound, deviation)
    return deviation
