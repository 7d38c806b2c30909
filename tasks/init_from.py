"""model.init_from before the job: the architecture from the checkpoint's config.json, and transformers' logits.

When a spec starts from a Hugging Face checkpoint, `fill_model` completes its model section before validation:
every architecture field the spec leaves out is taken from config.json, every one it states must agree with it
(a mismatch is a spec problem naming the field, the spec's value and config.json's). What the payload cannot
represent is refused there with the field (training/hf_load.py `read_hf_config`), as are weights it has no
parameter for (biases, fused experts) and pickle weights (safetensors only).

`with_init_check` computes, before every job, transformers' fp32 logits of the checkpoint on the load check's
fixed prompt (on this machine's CPU, `trust_remote_code=False`) and writes them to `init_check.json` in the run's
output; the training config names that file, and the job refuses to start when the logits it computes after
loading the weights under its layout differ (training/hf_load.py `initialise`).
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any

from tasks.errors import TransientError, UserError, is_connection_error
from training.config import MAX_SEQ_LEN, TrainConfig
from training.hf_config import (
    HF_CONFIG,
    HF_WEIGHTS_INDEX,
    HFLoadError,
    read_hf_config,
    tensor_index,
    unmapped_tensors,
    weight_files,
)
from training.storage import StorageConfig, check_storage_url, filesystem, is_local, join, local_path

log = logging.getLogger(__name__)

_CONFIG_NAMES = {
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_hidden": "intermediate_size",
    "mlp": "hidden_act (silu: swiglu)",
    "vocab_size": "vocab_size",
    "tie_embeddings": "tie_word_embeddings",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "moe": "num_local_experts / num_experts_per_tok / router_aux_loss_coef",
}
"""Our ModelConfig field -> the config.json field(s) it is read from (for the messages)."""


def _storage(data: dict[str, Any]) -> StorageConfig:
    try:
        return StorageConfig.model_validate(data.get("storage") or {})
    except ValueError:  # the storage section's own validation reports it
        return StorageConfig()


def _agrees(field: str, stated: Any, given: Any, n_heads: Any) -> bool:
    if field == "n_kv_heads" and stated is None:
        return given == n_heads
    if field == "moe" and isinstance(stated, dict) and isinstance(given, dict):
        return all(stated.get(k, v) == v for k, v in given.items())
    if isinstance(stated, (int, float)) and isinstance(given, (int, float)) and not isinstance(stated, bool):
        return float(stated) == float(given)
    return stated == given


def fill_model(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Raw spec data whose model section has config.json's architecture filled in where model.init_from is set,
    and the `field=value: problem; fix` lines of what disagrees or cannot be started from (TransientError when
    the checkpoint's storage does not answer)."""
    model = data.get("model")
    if not isinstance(model, dict) or model.get("init_from") is None:
        return data, []
    url = model["init_from"]
    try:
        check_storage_url(url)
    except (TypeError, ValueError, AttributeError):
        return data, []  # ModelConfig's validation names it
    storage = _storage(data)
    try:
        arch = read_hf_config(url, storage)
        unknown = unmapped_tensors(tensor_index(url, storage))
    except HFLoadError as err:
        return data, [f"model.init_from={url}: {err}" if not str(err).startswith("model.init_from") else str(err)]
    except Exception as err:
        if is_connection_error(err):  # botocore's and aiohttp's are not OSErrors
            raise TransientError(f"model.init_from={url}: the checkpoint's storage does not answer ({err})",
                                 "retry once it answers") from err  # fmt: skip
        if not isinstance(err, OSError):
            raise
        return data, [f"model.init_from={url}: cannot be read ({type(err).__name__}: {err}); point it at a Hugging "
                      "Face model folder this process may read"]  # fmt: skip
    problems = []
    if unknown:
        problems.append(
            f"model.init_from={url}: tensor {unknown[0]} has no place in the payload's Transformer ({len(unknown)} "
            "such tensors: biases, fused experts or another architecture); start from a Llama, Mistral or Mixtral "
            "checkpoint as transformers saves it"
        )
    filled = dict(model)
    for field, given in arch.fields.items():
        if field not in model:
            filled[field] = given
        elif not _agrees(field, model[field], given, model.get("n_heads")):
            problems.append(
                f"model.{field}={model[field]}: disagrees with config.json's {_CONFIG_NAMES[field]}={given} of "
                f"model.init_from={url}; remove model.{field} to take config.json's, or start from another checkpoint"
            )
    if "seq_len" not in model:
        filled["seq_len"] = min(arch.max_position_embeddings, MAX_SEQ_LEN)
    seq_len = filled["seq_len"]
    if isinstance(seq_len, int) and seq_len > arch.max_position_embeddings:
        problems.append(
            f"model.seq_len={seq_len}: longer than config.json's max_position_embeddings="
            f"{arch.max_position_embeddings} of model.init_from={url} (the payload's rotary embedding does not "
            f"scale); use at most {arch.max_position_embeddings}"
        )
    if arch.sliding_window is not None and isinstance(seq_len, int) and seq_len > arch.sliding_window:
        problems.append(
            f"model.seq_len={seq_len}: longer than config.json's sliding_window={arch.sliding_window} of "
            f"model.init_from={url} (the payload's attention sees the whole sequence); use at most "
            f"{arch.sliding_window}"
        )
    return {**data, "model": filled}, problems


def transformers_logits(url: str, prompt_ids: list[int], storage: StorageConfig) -> tuple[Any, str]:
    """transformers' fp32 logits (T x vocab) of the checkpoint at `url` on `prompt_ids`, on CPU, without remote
    code; and transformers' version. A remote folder is copied to a temporary one first (config and weights)."""
    import torch  # noqa: PLC0415 - heavy; only with model.init_from
    import transformers  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    def run(folder: str) -> Any:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=False)
        model.eval()
        with torch.no_grad():
            return model(torch.tensor([prompt_ids], dtype=torch.long)).logits[0].float()

    if is_local(url):
        return run(local_path(url)), transformers.__version__
    fs, root = filesystem(url, storage)
    with tempfile.TemporaryDirectory(prefix="tdeploy-init-from-") as folder:
        index = [HF_WEIGHTS_INDEX] if fs.exists(join(root, HF_WEIGHTS_INDEX)) else []  # sharded weights
        for name in [HF_CONFIG, *index, *weight_files(url, storage)]:
            fs.get(join(root, name), f"{folder}/{name}")
        return run(folder), transformers.__version__


def with_init_check(train: TrainConfig) -> TrainConfig:
    """`train` naming the init_check.json written for it in run.output_url (unchanged without model.init_from)."""
    model = train.model
    if model.init_from is None:
        return train
    from training.hf_load import HF_INIT_CHECK, InitCheck, check_prompt, write_init_check  # torch: a job's input

    prompt = check_prompt(model.vocab_size, model.seq_len)
    try:
        logits, version = transformers_logits(model.init_from, prompt, train.storage)
    except (OSError, ValueError, RuntimeError) as err:  # safetensors and torch raise the last for bad files
        if is_connection_error(err):
            raise TransientError(f"model.init_from={model.init_from}: cannot be read ({err})", "retry") from err
        raise UserError(
            f"model.init_from={model.init_from}: transformers cannot load it ({type(err).__name__}: {err})",
            "check that the folder is a model transformers saved (config.json and *.safetensors)",
        ) from err
    url = join(train.run.output_url, HF_INIT_CHECK)
    write_init_check(url, InitCheck(model.init_from, prompt, logits, version), train.storage)
    log.info("init check: transformers %s logits of %s written to %s", version, model.init_from, url)
    return train.model_copy(update={"init_check_url": url})

