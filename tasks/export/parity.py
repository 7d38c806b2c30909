"""The export's load-time check: the written folder, loaded back by transformers, gives the checkpoint's logits.

Before EXPORT.json is written the folder is loaded as any user would load it (`AutoModelForCausalLM`, fp32, CPU,
`trust_remote_code=False`) and its logits on held-out prompts are compared with our own model's (training/model.py
with the checkpoint's weights). Greedy agreement alone is too weak: an export that wrote transformers' default
rope_theta instead of the trained one gave logits up to 1.02 apart and still agreed on 4/4 greedy prompts.

Three things are compared:
- the function-changing config fields transformers read (rope_theta, rms_norm_eps, the shapes, the activation):
  always, from the config transformers built, so a field it fills with its own default is caught too;
- the logits on `PARITY_PROMPTS` prompts of the dataset's held-out split (fixed token ids where the dataset cannot
  be read here), within `tolerance` (below);
- on a logit mismatch only, every written tensor mapped back to ours (`training.hf_names.our_name`) and compared
  with the checkpoint's, so that the error names the largest-deviating one.

Both models sit in memory at once, in fp32 on CPU: twice the weights' fp32 size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from tasks.errors import UserError

if TYPE_CHECKING:
    import torch

    from training.config import ModelConfig, TrainConfig

log = logging.getLogger(__name__)

PARITY_PROMPTS = 4
PARITY_PROMPT_TOKENS = 64
"""Tokens per prompt (at most the model's seq_len): enough positions for a wrong rotary base to show."""
PARITY_SEED = 0
# fp32 on both sides: the two forwards differ only in the order of their sums (SDPA against our attention, fused
# against separate projections): 0 to 1e-5 on the test models' logits, growing with the logits' magnitude and the
# depth. A wrong tensor or config field moves them by far more: the default rope_theta instead of a trained 500
# gave 3.1 on a 2-layer model with logits up to 4 (1.02 on the run the issue reports), swapped k/v projections 0.64
# on a random-init one with logits up to 1.4 (tolerance 1.7e-4).
PARITY_ATOL = 1e-4
PARITY_RTOL = 1e-4
"""Tolerance on |logit difference|: PARITY_ATOL + PARITY_RTOL * max |logit| of the checkpoint's model."""


class ExportParityError(UserError):
    """The written folder does not reproduce the checkpoint under transformers; nothing is published."""

    def __init__(self, message: str, fix: str, parity: ExportParity) -> None:
        super().__init__(message, fix)
        self.parity = parity
        self._args = (message, fix, parity)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle by the constructor's arguments (Prefect stores a failed task's exception)."""
        return (type(self), self._args)


class TensorDeviation(BaseModel):
    """One written tensor against the checkpoint's: its names and the largest absolute difference."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    hf_name: str
    our_name: str | None
    """None: the folder holds a tensor our model does not have."""
    max_abs_diff: float | None
    """None: the shapes differ, or one side lacks the tensor."""
    problem: str = ""


class ExportParity(BaseModel):
    """The export's load-time check: what was compared, the deviation and the verdict (EXPORT.json `parity`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    prompts: int
    prompt_tokens: int
    prompts_from: str
    """Where the prompts came from: the dataset's held-out split, or fixed token ids (and why)."""
    max_abs_logit_diff: float
    tolerance: float
    inputs: Literal["prompts", "images"] = "prompts"
    """What `prompts` counts: token prompts (a language model) or images (a classifier, `prompt_tokens` its image
    tokens)."""
    config_mismatches: list[str] = []
    """Function-changing config fields whose value transformers read differs from the trained one."""
    worst_tensor: TensorDeviation | None = None
    """On a logit mismatch: the written tensor that deviates most from the checkpoint's."""

    @property
    def passed(self) -> bool:
        """The logits agree within the tolerance and every config field matches."""
        return not self.config_mismatches and self.max_abs_logit_diff <= self.tolerance


@dataclass(frozen=True)
class _Field:
    """A config.json field that changes the model's function: its name, the trained value, the value read."""

    name: str
    ours: Callable[[ModelConfig], Any]
    theirs: Callable[[Any], Any]


def _rope(config: Any, key: str) -> Any:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get(key, getattr(config, key, None))


_FIELDS: tuple[_Field, ...] = (
    _Field("vocab_size", lambda m: m.vocab_size, lambda c: c.vocab_size),
    _Field("hidden_size", lambda m: m.d_model, lambda c: c.hidden_size),
    _Field("intermediate_size", lambda m: m.ffn_hidden, lambda c: c.intermediate_size),
    _Field("num_hidden_layers", lambda m: m.n_layers, lambda c: c.num_hidden_layers),
    _Field("num_attention_heads", lambda m: m.n_heads, lambda c: c.num_attention_heads),
    _Field("num_key_value_heads", lambda m: m.kv_heads, lambda c: c.num_key_value_heads),
    _Field("head_dim", lambda m: m.head_dim, lambda c: getattr(c, "head_dim", None)),
    _Field("hidden_act", lambda m: "silu", lambda c: c.hidden_act),
    _Field("rms_norm_eps", lambda m: m.norm_eps, lambda c: c.rms_norm_eps),
    _Field("rope_theta", lambda m: m.rope_theta, lambda c: _rope(c, "rope_theta")),
    _Field("rope_type", lambda m: "default", lambda c: _rope(c, "rope_type") or "default"),
    _Field("tie_word_embeddings", lambda m: m.tie_embeddings, lambda c: c.tie_word_embeddings),
    _Field("num_local_experts", lambda m: m.moe and m.moe.n_experts, lambda c: getattr(c, "num_local_experts", None)),
    _Field("num_experts_per_tok", lambda m: m.moe and m.moe.top_k, lambda c: getattr(c, "num_experts_per_tok", None)),
)  # fmt: skip


def config_mismatches(model: ModelConfig, config: Any) -> list[str]:
    """The function-changing fields of a transformers config (as loaded, defaults filled in) that differ from
    `model`, each as `field: folder value vs trained value`."""
    problems = []
    for spec in _FIELDS:
        ours, theirs = spec.ours(model), spec.theirs(config)
        same = (
            abs(float(ours) - float(theirs)) <= 1e-12 * max(1.0, abs(float(ours)))
            if isinstance(ours, float) and isinstance(theirs, int | float)
            else ours == theirs
        )
        if not same:
            problems.append(f"{spec.name}: {theirs!r} in the folder (as transformers reads it) vs {ours!r} trained")
    return problems


def parity_prompts(train: TrainConfig, vocab_size: int, seq_len: int) -> tuple[list[list[int]], str]:
    """PARITY_PROMPTS prompts of at most PARITY_PROMPT_TOKENS tokens from the dataset's held-out split (the
    training split when it has none), spread over it; fixed token ids below `vocab_size` where the dataset cannot
    be read here. Also says where they came from."""
    import torch

    from training.dataset import DatasetError, TokenDataset, read_manifest

    length = min(PARITY_PROMPT_TOKENS, seq_len)
    url = train.data.dataset_url
    try:
        splits = read_manifest(url, train.storage, train.data.sources).splits
        split = train.data.val_split if train.data.val_split in splits else train.data.train_split
        data = TokenDataset(url, split, length - 1, train.storage, vocab_size=vocab_size, trusted=train.data.sources)
        if len(data) > 0:
            stride = max(1, len(data) // PARITY_PROMPTS)
            prompts = [data.sample((i * stride) % len(data)).tolist() for i in range(PARITY_PROMPTS)]
            return prompts, f"split {split!r} of {url}"
        why = f"split {split!r} of {url} holds no sample of {length} tokens"
    except DatasetError as err:
        why = f"the dataset {url} cannot be read here: {err.problem}"
    except OSError as err:
        why = f"the dataset {url} cannot be read here: {err}"
    generator = torch.Generator().manual_seed(PARITY_SEED)
    ids = torch.randint(0, vocab_size, (PARITY_PROMPTS, length), generator=generator)
    return ids.tolist(), f"fixed token ids (seed {PARITY_SEED}): {why}"


def _folder_tensors(folder: Path) -> dict[str, tuple[Path, str]]:
    """Every tensor the folder's safetensors files hold: name -> (file, name)."""
    from safetensors import safe_open

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                found[name] = (path, name)
    return found


def tensor_deviations(
    folder: Path,
    ours: dict[str, torch.Tensor],
    tied: bool,
    our_name: Callable[[str], str | None] | None = None,
) -> list[TensorDeviation]:
    """Each tensor written into `folder` against our checkpoint's tensor of the same meaning (largest first),
    plus any of ours the folder lacks. `our_name` maps a written name back to ours (ValueError for one it does
    not know); None: the language model's table (training/hf_names.py)."""
    from safetensors import safe_open

    if our_name is None:
        from training.hf_names import our_name

    deviations, seen = [], set()
    for theirs, (path, key) in _folder_tensors(folder).items():
        try:
            name = our_name(theirs)
        except ValueError as err:
            deviations.append(TensorDeviation(hf_name=theirs, our_name=None, max_abs_diff=None, problem=str(err)))
            continue
        if name is None or name not in ours:
            problem = "the checkpoint's model has no such parameter"
            deviations.append(TensorDeviation(hf_name=theirs, our_name=name, max_abs_diff=None, problem=problem))
            continue
        seen.add(name)
        with safe_open(str(path), framework="pt") as handle:
            written = handle.get_tensor(key)
        expected = ours[name]
        if tuple(written.shape) != tuple(expected.shape):
            problem = f"shape {list(written.shape)} written, the checkpoint's is {list(expected.shape)}"
            deviations.append(TensorDeviation(hf_name=theirs, our_name=name, max_abs_diff=None, problem=problem))
            continue
        diff = (written.float() - expected.float()).abs().max().item() if written.numel() else 0.0
        deviations.append(TensorDeviation(hf_name=theirs, our_name=name, max_abs_diff=diff))
    for name in ours:
        if name not in seen and not (tied and name == "lm_head.weight"):
            deviations.append(
                TensorDeviation(hf_name="-", our_name=name, max_abs_diff=None, problem="not in the folder")
            )
    # a missing or misshapen tensor first, then by size of the difference
    return sorted(deviations, key=lambda d: (d.max_abs_diff is not None, -(d.max_abs_diff or 0.0)))


def _transformers_logits(folder: Path, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The logits of the folder loaded as its users load it (fp32, CPU, no remote code), and its config."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, trust_remote_code=False, device_map=None
    ).eval()
    with torch.no_grad():
        logits = loaded(ids).logits.float()
    config = loaded.config
    del loaded
    return logits, config


def check_export(folder: Path, ours: torch.nn.Module, prompts: list[list[int]], prompts_from: str) -> ExportParity:
    """Load `folder` with transformers and compare it with `ours` (the checkpoint's model, fp32, eval) on
    `prompts`; the finding, not yet judged (see `require_parity`)."""
    import torch

    model: ModelConfig = ours.cfg
    ids = torch.tensor(prompts, dtype=torch.long)
    theirs, config = _transformers_logits(folder, ids)
    with torch.no_grad():
        expected = ours(ids)[0].float()
    diff = (theirs - expected).abs().max().item() if theirs.shape == expected.shape else float("inf")
    tolerance = PARITY_ATOL + PARITY_RTOL * expected.abs().max().item()
    mismatches = config_mismatches(model, config)
    worst = None
    if diff > tolerance or mismatches:
        state = {name: tensor.detach() for name, tensor in ours.state_dict().items()}
        deviations = tensor_deviations(folder, state, model.tie_embeddings)
        worst = deviations[0] if deviations else None
    return ExportParity(
        prompts=len(prompts),
        prompt_tokens=len(prompts[0]) if prompts else 0,
        prompts_from=prompts_from,
        max_abs_logit_diff=diff,
        tolerance=tolerance,
        config_mismatches=mismatches,
        worst_tensor=worst,
    )


_LM_WRITERS = "the name table training/hf_names.py or the config writer tasks/export/hf.py"


def require_parity(parity: ExportParity, source: str, writers: str = _LM_WRITERS) -> None:
    """ExportParityError naming the config fields and the largest-deviating tensor unless `parity` passed;
    `writers` names the code that wrote the folder (where the fix is)."""
    if parity.passed:
        return
    parts = [
        f"the exported folder loaded by transformers gives logits up to {parity.max_abs_logit_diff:.4g} from "
        f"{source}'s (tolerance {parity.tolerance:.2g}, {parity.prompts} {parity.inputs} of {parity.prompt_tokens} "
        f"tokens from {parity.prompts_from})"
    ]
    if parity.config_mismatches:
        parts.append("config.json differs: " + "; ".join(parity.config_mismatches))
    worst = parity.worst_tensor
    if worst is not None and (worst.max_abs_diff is None or worst.max_abs_diff > 0):
        figure = f"max |diff| {worst.max_abs_diff:.4g}" if worst.max_abs_diff is not None else worst.problem
        parts.append(f"largest-deviating tensor {worst.hf_name} (ours {worst.our_name}): {figure}")
    elif not parity.config_mismatches:
        parts.append("every written tensor equals the checkpoint's, so the difference is in how the folder is read")
    raise ExportParityError(
        "export parity failed: " + "; ".join(parts),
        f"the export wrote something other than the checkpoint ({writers} is at fault); nothing was published: fix "
        "the writer and export again",
        parity,
    )
