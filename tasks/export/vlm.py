"""A vision-language checkpoint (training/vlm.py, `model.kind: vlm`) as a Hugging Face LLaVA folder.

`LlavaForConditionalGeneration` with a SigLIP vision tower and a Llama language model is our model part for part:
the SigLIP-shaped encoder (bias-carrying Conv2d patch embedding, learned position embeddings, pre-norm LayerNorm
blocks, biased q/k/v/out projections, exact GELU), LLaVA's projector (linear_1, GELU, linear_2) and the language
model under the Llama names of training/hf_names.py (`language_model.` in front). LLaVA feeds the projector the
vision tower's last hidden state before `post_layernorm` (vision_feature_layer -1, strategy "full": every patch),
which is why our encoder has no final norm; SiglipVisionModel still holds a post_layernorm, written as the identity
(weight 1, bias 0) and never run. The folder:

- config.json: LlavaConfig (text_config from tasks/export/hf.py `hf_config`, vision_config siglip_vision_model
  without the pooling head, image_token_index, image_seq_length = the image's patch tokens);
- model.safetensors (or shards and an index) under the names transformers' LLaVA checkpoints use;
- tokenizer.json / tokenizer_config.json: the run's tokenizer (tasks/export/hf.py `write_tokenizer`) plus the
  special token `<image>`, whose id is the first one past the tokenizer's vocabulary (the language model's
  vocab_size must leave room for it: its embedding row is never read, the image tokens replace it);
- processor_config.json (LlavaProcessor: SiglipImageProcessor resizing to image_size, rescale 1/255, mean = std =
  0.5, the model's own first op; crop_size, which vLLM's LLaVA processor reads to count image tokens) and
  chat_template.jinja (an image part renders `<image>`, a text part its text: the caption prompt is the image);
- generation_config.json: greedy, stop and pad at EOS.

At export time the folder is loaded as its users load it (AutoProcessor on PIL images, then
LlavaForConditionalGeneration in fp32 on CPU) and its logits on held-out images with their captions are compared
with our model's (`check_vlm_export`); a mismatch names the config field or the largest-deviating tensor and
nothing is published (tasks/export/parity.py ExportParityError).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tasks.export.hf import (
    CONFIG,
    GENERATION_CONFIG,
    TOKENIZER,
    TOKENIZER_CONFIG,
    WEIGHTS_INDEX,
    ExportError,
    WeightsWritten,
    hf_config,
    plan_named_shards,
    shard_name,
    write_tokenizer,
)
from tasks.export.hf import unexportable as lm_unexportable
from tasks.export.parity import ExportParity, config_mismatches, require_parity, tensor_deviations
from training import hf_names, hf_vision_names
from training.image_dataset import ImageDataset, ImageDatasetError, read_image_manifest
from training.vlm import VisionLanguageModel

if TYPE_CHECKING:
    from training.checkpoint import CheckpointManager, ModelCard, TensorInfo
    from training.config import ModelConfig, VisionConfig
    from training.storage import StorageConfig

ARCHITECTURE = "LlavaForConditionalGeneration"
PROCESSOR_CONFIG = "processor_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
IMAGE_TOKEN = "<image>"
PIL_BICUBIC = 3  # SigLIP's resample; the prepared images already have the model's size, so it does not run there
PIXEL_MEAN = 0.5  # training/vision.py normalises x/255 to (x - 0.5) / 0.5 per channel
PIXEL_STD = 0.5
PARITY_IMAGES = 4
PARITY_SEED = 0
# Both sides in fp32 on the same uint8 pixels and ids: the processor's rescale and normalisation are the model's
# own (x/255 - 0.5)/0.5, and the encoder, projector and language model run the same operations; measured max
# |logit diff| 0.0 on the tests' models (tests/integration/test_vlm_export.py, logits up to 6), while one encoder
# tensor perturbed by 0.01 moves them by far more than the tolerance. The tolerance is the Llama export's (sums
# in another order where another CPU's SDPA kernel is chosen).
PARITY_ATOL = 1e-4
PARITY_RTOL = 1e-4
WRITERS = "the LLaVA name table or config writer in tasks/export/vlm.py (language model: training/hf_names.py)"
# A chat message's image part renders the image placeholder, a text part its text, in order: the captioning
# prompt is the image alone, as in training (no role markers: the model never saw any).
CHAT_TEMPLATE_TEXT = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}" + IMAGE_TOKEN + "{%- elif part['type'] == 'text' -%}"
    "{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}"
)
_POST_NORM = "vision_tower.post_layernorm.{p}"
_IDENTITY = "(identity) "  # our_name of post_layernorm: not a parameter of ours, written as the identity

# (our name, the LlavaForConditionalGeneration name): the tower's rows are the shared table's
# (training/hf_vision_names.py).
_TABLE: tuple[tuple[str, str], ...] = hf_vision_names.prefixed(hf_vision_names.SIGLIP, "vision.", "vision_tower.") + (
    ("projector.linear_1.{p}", "multi_modal_projector.linear_1.{p}"),
    ("projector.linear_2.{p}", "multi_modal_projector.linear_2.{p}"),
)
_LM_PREFIX = "language_model."
_pattern = hf_vision_names.pattern


_NAMES = tuple((_pattern(ours), theirs) for ours, theirs in _TABLE)
_REVERSE = tuple((_pattern(theirs), ours) for ours, theirs in _TABLE)
"""Built once at import: a fault that patches `_NAMES` for the export is found by the load-back check, which maps
the written names back with this one."""


def hf_name(name: str, tied: bool = False) -> str | None:
    """The LLaVA name of our VisionLanguageModel parameter `name` (None for a tied lm_head); ExportError for
    another."""
    if name.startswith("lm."):
        try:
            theirs = hf_names.hf_name(name.removeprefix("lm."), tied)
        except hf_names.UnknownName:
            theirs = None
            tied = False
        if theirs is not None or tied:
            return None if theirs is None else _LM_PREFIX + theirs
    for pattern, template in _NAMES:
        match = pattern.fullmatch(name)
        if match:
            return template.format(**match.groupdict())
    raise ExportError(
        "tensor",
        name,
        "is not a parameter of training/vlm.py's VisionLanguageModel, so it has no LLaVA name",
        "export a checkpoint this trainer saved (or add the name to tasks/export/vlm.py _TABLE)",
    )


def our_name(name: str) -> str:
    """Our VisionLanguageModel name of the LLaVA tensor `name`; ValueError for another."""
    if name.startswith(_LM_PREFIX):
        return "lm." + hf_names.our_name(name.removeprefix(_LM_PREFIX))
    if name in (_POST_NORM.format(p="weight"), _POST_NORM.format(p="bias")):
        return _IDENTITY + name
    for pattern, template in _REVERSE:
        match = pattern.fullmatch(name)
        if match:
            return template.format(**match.groupdict())
    raise ValueError(f"{name}: not a LlavaForConditionalGeneration tensor name that tasks/export/vlm.py writes")


def image_token_id(card: ModelCard) -> int:
    """The id of `<image>`: the first past the tokenizer's vocabulary (ExportError when the model has no room)."""
    if card.vocab_size >= card.model.vocab_size:
        raise ExportError(
            "model.vocab_size",
            card.model.vocab_size,
            f"the tokenizer uses every id of the model's vocabulary ({card.vocab_size}); the LLaVA folder needs one "
            f"more for the {IMAGE_TOKEN} placeholder, which the exported tokenizer adds",
            f"train with model.vocab_size of at least {card.vocab_size + 1} (the extra embedding row is never read)",
        )
    return card.vocab_size


def unexportable(model: ModelConfig) -> list[ExportError]:
    """What LlavaForConditionalGeneration (SigLIP + Llama) cannot express of `model` ([] when it exports)."""
    if model.kind != "vlm" or model.vision is None:
        return [
            ExportError(
                "model.kind", model.kind, "is not a vision-language model: tasks/export/vlm.py writes LLaVA only",
                "export it with tasks/export/step.py export_checkpoint (tdeploy export), which picks the exporter "
                "by model.kind",
            )
        ]  # fmt: skip
    problems = lm_unexportable(model)
    vision = model.vision
    if vision.pooling != "mean":
        problems.append(
            ExportError(
                "model.vision.pooling", vision.pooling,
                "LLaVA's SigLIP vision tower has no class token",
                "train the vision-language model with model.vision.pooling: mean",
            )
        )  # fmt: skip
    if vision.projector_hidden not in (None, model.d_model):
        problems.append(
            ExportError(
                "model.vision.projector_hidden", vision.projector_hidden,
                f"LLaVA's projector maps the encoder's width to the language model's d_model={model.d_model} and "
                "keeps that width (linear_1: d_vision -> d_model, linear_2: d_model -> d_model); another hidden "
                "size has no place in its config",
                f"train with model.vision.projector_hidden unset or {model.d_model}",
            )
        )  # fmt: skip
    return problems


def check_exportable(model: ModelConfig) -> VisionConfig:
    """The vision section of `model` when LLaVA expresses it; else the first problem."""
    problems = unexportable(model)
    if problems:
        raise problems[0]
    assert model.vision is not None
    return model.vision


def llava_config(card: ModelCard, dtype: str = "float32") -> dict[str, Any]:
    """config.json (LlavaConfig) of the card's model; `dtype` into torch_dtype."""
    model = card.model
    vision = check_exportable(model)
    text = hf_config(model, eos_id=card.eos_id, bos_id=card.eos_id, pad_id=card.eos_id, dtype=dtype)
    text.pop("architectures")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llava",
        "text_config": text,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": vision.d_model,
            "intermediate_size": vision.ffn_hidden,
            "num_hidden_layers": vision.n_layers,
            "num_attention_heads": vision.n_heads,
            "num_channels": vision.channels,
            "image_size": vision.image_size,
            "patch_size": vision.patch_size,
            "hidden_act": "gelu",  # transformers' "gelu" is the exact erf GELU, as training/vision.py's
            "layer_norm_eps": vision.norm_eps,
            "attention_dropout": 0.0,
            "vision_use_head": False,
        },
        "image_token_index": image_token_id(card),
        "image_seq_length": vision.num_patches,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "tie_word_embeddings": model.tie_embeddings,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def processor_config(vision: VisionConfig) -> dict[str, Any]:
    """processor_config.json: the LlavaProcessor (its SiglipImageProcessor turns an image into our model's input)."""
    size = {"height": vision.image_size, "width": vision.image_size}
    return {
        "processor_class": "LlavaProcessor",
        "image_processor": {
            "image_processor_type": "SiglipImageProcessor",
            "do_convert_rgb": True,
            "do_resize": True,
            "size": size,
            "crop_size": size,  # not cropped (do_center_crop false); vLLM counts image tokens from it
            "do_center_crop": False,
            "resample": PIL_BICUBIC,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [PIXEL_MEAN] * vision.channels,
            "image_std": [PIXEL_STD] * vision.channels,
        },
        "image_token": IMAGE_TOKEN,
        "patch_size": vision.patch_size,
        "num_additional_image_tokens": 0,
        "vision_feature_select_strategy": "full",
    }


def write_vlm_configs(card: ModelCard, out_dir: Path, dtype: str) -> list[str]:
    """config.json, generation_config.json, processor_config.json and chat_template.jinja; the files."""
    (out_dir / CONFIG).write_text(json.dumps(llava_config(card, dtype), indent=2))
    generation = {"bos_token_id": card.eos_id, "eos_token_id": card.eos_id, "pad_token_id": card.eos_id,
                  "do_sample": False}  # fmt: skip
    (out_dir / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2))
    (out_dir / PROCESSOR_CONFIG).write_text(json.dumps(processor_config(check_exportable(card.model)), indent=2))
    (out_dir / CHAT_TEMPLATE).write_text(CHAT_TEMPLATE_TEXT)
    return [CONFIG, GENERATION_CONFIG, PROCESSOR_CONFIG, CHAT_TEMPLATE]


def write_vlm_tokenizer(card: ModelCard, storage: StorageConfig, out_dir: Path) -> list[str]:
    """The run's tokenizer (tasks/export/hf.py `write_tokenizer`) with `<image>` added at `image_token_id`; the
    files.

    Special tokens in prompt text are tokenizer tokens here (split_special_tokens false), unlike the language
    model's export of the bytes tokenizer: the processor expands `<image>` in the text into the image's tokens."""
    from tokenizers import AddedToken, Tokenizer

    files = write_tokenizer(card, storage, out_dir)
    tokenizer = Tokenizer.from_file(str(out_dir / TOKENIZER))
    tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    wanted = image_token_id(card)
    if tokenizer.token_to_id(IMAGE_TOKEN) != wanted:
        raise ExportError(
            "tokenizer", card.tokenizer.url or card.tokenizer.kind,
            f"{IMAGE_TOKEN} got id {tokenizer.token_to_id(IMAGE_TOKEN)}, not {wanted} (the first past the "
            f"{card.vocab_size} ids the card records): the tokenizer's size is not the dataset's vocab_size",
            "export with the tokenizer the dataset was made with",
        )  # fmt: skip
    (out_dir / TOKENIZER).write_text(tokenizer.to_str())
    config = json.loads((out_dir / TOKENIZER_CONFIG).read_text())
    config.pop("split_special_tokens", None)
    config.update({"extra_special_tokens": [IMAGE_TOKEN], "processor_class": "LlavaProcessor"})
    (out_dir / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2))
    return files


def expected_tensors(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes of the vision-language model (tied weights once), built on the meta device."""
    with torch.device("meta"):
        built = VisionLanguageModel(model)
    return {name: tuple(param.shape) for name, param in built.named_parameters()}


def _plan(
    tensors: dict[str, TensorInfo], model: ModelConfig, max_shard_bytes: int
) -> list[list[tuple[str, str, TensorInfo]]]:
    """(our name, theirs, info) cut into files of at most `max_shard_bytes`; ExportError when the checkpoint does
    not hold exactly the model's parameters."""
    return plan_named_shards(
        tensors, expected_tensors(model), lambda name: hf_name(name, model.tie_embeddings),
        "its vision-language model", max_shard_bytes,
    )  # fmt: skip


def export_vlm_weights(
    checkpoints: CheckpointManager, step: int, model: ModelConfig, out_dir: Path, max_shard_bytes: int
) -> WeightsWritten:
    """The model's weights of checkpoint `step` into `out_dir` as safetensors under the LLaVA names (sharded above
    `max_shard_bytes`, with the index), one shard in memory at a time; post_layernorm as the identity."""
    from safetensors.torch import save_file

    vision = check_exportable(model)
    shards = _plan(checkpoints.model_tensors(step), model, max_shard_bytes)
    identity = {_POST_NORM.format(p="weight"): torch.ones(vision.d_model),
                _POST_NORM.format(p="bias"): torch.zeros(vision.d_model)}  # fmt: skip
    files, weight_map, n_params, total = [], {}, 0, 0
    for index, shard in enumerate(shards):
        name = shard_name(index, len(shards))
        loaded = checkpoints.load_model_tensors(step, {ours: info for ours, _, info in shard})
        tensors = {theirs: _to_hf(ours, loaded.pop(ours)).contiguous() for ours, theirs, _ in shard}
        if index == len(shards) - 1:
            tensors.update(identity)
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        for theirs, tensor in tensors.items():
            weight_map[theirs] = name
            if theirs not in identity:
                n_params += tensor.numel()
            total += tensor.numel() * tensor.element_size()
        files.append(name)
        del tensors, loaded
    if len(shards) > 1:
        index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / WEIGHTS_INDEX).write_text(json.dumps(index_doc, indent=2))
        files.append(WEIGHTS_INDEX)
    return WeightsWritten(files, n_params, total)


def _to_hf(ours: str, tensor: torch.Tensor) -> torch.Tensor:
    """Our tensor in the LLaVA layout: the position embeddings are an nn.Embedding's (n_tokens, d) there."""
    return tensor.reshape(tensor.shape[1:]) if ours == "vision.pos_emb" else tensor


# ---- the load-back check ----------------------------------------------------------------------------------------


def parity_samples(
    dataset_url: str, storage: StorageConfig, val_split: str, train_split: str, model: ModelConfig, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """PARITY_IMAGES uint8 images (B, C, H, W) with their captions (B, L) from the dataset's held-out split (the
    training split when it has none); fixed random pixels and ids where it cannot be read or holds another size.
    Also says where they came from."""
    vision = check_exportable(model)
    try:
        manifest = read_image_manifest(dataset_url, storage)
        split = val_split if val_split in manifest.splits else train_split
        if manifest.image_size != vision.image_size:
            why = f"its images are {manifest.image_size} px, the model's {vision.image_size} px"
        else:
            data = ImageDataset(dataset_url, split, storage, expect_kind="captions")
            if len(data) > 0:
                count = min(PARITY_IMAGES, len(data))
                stride = max(1, len(data) // count)
                batch = data.batch([(k * stride) % len(data) for k in range(count)])
                captions = batch.targets[:, : model.seq_len - vision.num_patches]
                return batch.images, captions, f"split {split!r} of {dataset_url}"
            why = f"split {split!r} of {dataset_url} holds no image"
    except (ImageDatasetError, OSError) as err:
        why = f"the dataset {dataset_url} cannot be read here: {err}"
    generator = torch.Generator().manual_seed(PARITY_SEED)
    shape = (PARITY_IMAGES, vision.channels, vision.image_size, vision.image_size)
    images = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
    length = min(16, model.seq_len - vision.num_patches)
    captions = torch.randint(0, vocab_size, (PARITY_IMAGES, length), generator=generator)
    return images, captions, f"random pixels and ids (seed {PARITY_SEED}): {why}"


def pil_images(images: torch.Tensor) -> list[Any]:
    """uint8 (B, C, H, W) as PIL images, as a user hands them to the processor (and the serving check sends)."""
    from PIL import Image

    return [Image.fromarray(a) for a in images.permute(0, 2, 3, 1).numpy()]


def _config_mismatches(card: ModelCard, config: Any, processor: Any, image_ids: list[int]) -> list[str]:
    """The function-changing fields transformers read from the folder that differ from the trained model."""
    model = card.model
    vision = check_exportable(model)
    vc, ip = config.vision_config, processor.image_processor
    size = dict(ip.size) if ip.size is not None else {}
    fields = [
        ("vision hidden_size", vision.d_model, vc.hidden_size),
        ("vision intermediate_size", vision.ffn_hidden, vc.intermediate_size),
        ("vision num_hidden_layers", vision.n_layers, vc.num_hidden_layers),
        ("vision num_attention_heads", vision.n_heads, vc.num_attention_heads),
        ("vision hidden_act", "gelu", vc.hidden_act),
        ("vision layer_norm_eps", vision.norm_eps, vc.layer_norm_eps),
        ("vision image_size", vision.image_size, vc.image_size),
        ("vision patch_size", vision.patch_size, vc.patch_size),
        ("projector_hidden_act", "gelu", config.projector_hidden_act),
        ("vision_feature_layer", -1, config.vision_feature_layer),
        ("vision_feature_select_strategy", "full", config.vision_feature_select_strategy),
        ("image_token_id", image_token_id(card), config.image_token_id),
        ("processor size", [vision.image_size] * 2, [size.get("height"), size.get("width")]),
        ("processor rescale_factor", 1 / 255, ip.rescale_factor),
        ("processor image_mean", [PIXEL_MEAN] * vision.channels, list(ip.image_mean or [])),
        ("processor image_std", [PIXEL_STD] * vision.channels, list(ip.image_std or [])),
        ("processor <image> expansion", [image_token_id(card)] * vision.num_patches, image_ids),
    ]
    problems = [f"{name}: {theirs!r} in the folder (as transformers reads it) vs {ours!r} trained"
                for name, ours, theirs in fields if not _same(ours, theirs)]  # fmt: skip
    return problems + [f"text_config {p}" for p in config_mismatches(model, config.text_config)]


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) and isinstance(theirs, int | float):
        return abs(ours - float(theirs)) <= 1e-12 * max(1.0, abs(ours))
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return all(_same(a, b) for a, b in zip(ours, theirs, strict=True))
    return bool(ours == theirs)


def transformers_logits(folder: Path, images: torch.Tensor, captions: torch.Tensor, image_id: int) -> tuple[
    torch.Tensor, Any, Any, list[int]
]:  # fmt: skip
    """The folder's logits on [`<image>` x P] + captions with `images` (uint8) as its users get them: AutoProcessor on
    PIL images, LlavaForConditionalGeneration in fp32 on CPU, no remote code; also its config, its processor and
    the ids the processor makes of the prompt `<image>` (the image placeholder expanded)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    processor = transformers.AutoProcessor.from_pretrained(str(folder))
    pixels = processor.image_processor(images=pil_images(images), return_tensors="pt")["pixel_values"]
    expanded = processor(images=pil_images(images[:1]), text=IMAGE_TOKEN, return_tensors="pt")["input_ids"][0]
    loaded = transformers.LlavaForConditionalGeneration.from_pretrained(
        str(folder), dtype=torch.float32, trust_remote_code=False, device_map=None
    ).eval()
    patches = loaded.config.image_seq_length
    ids = torch.cat([torch.full((len(images), patches), image_id, dtype=torch.long), captions], dim=1)
    with torch.no_grad():
        logits = loaded(input_ids=ids, pixel_values=pixels).logits.float()
    config = loaded.config
    del loaded
    return logits, config, processor, expanded.tolist()


def check_vlm_export(
    folder: Path, ours: VisionLanguageModel, card: ModelCard, images: torch.Tensor, captions: torch.Tensor,
    images_from: str,
) -> ExportParity:  # fmt: skip
    """Load `folder` with transformers and compare its logits on `images` and `captions` with `ours` (the
    checkpoint's model, fp32, eval); the finding, not yet judged (`require_parity`)."""
    theirs, config, processor, expanded = transformers_logits(folder, images, captions, image_token_id(card))
    with torch.no_grad():
        expected = ours(images, captions)[0].float()
    diff = (theirs - expected).abs().max().item() if theirs.shape == expected.shape else float("inf")
    tolerance = PARITY_ATOL + PARITY_RTOL * expected.abs().max().item()
    mismatches = _config_mismatches(card, config, processor, expanded)
    worst = None
    if diff > tolerance or mismatches:
        state = {name: _to_hf(name, tensor.detach()) for name, tensor in ours.state_dict().items()}
        if card.model.tie_embeddings:
            state.pop("lm.lm_head.weight", None)  # written once, as the embedding
        vision = check_exportable(card.model)
        for p, value in (("weight", torch.ones(vision.d_model)), ("bias", torch.zeros(vision.d_model))):
            state[_IDENTITY + _POST_NORM.format(p=p)] = value
        deviations = tensor_deviations(folder, state, card.model.tie_embeddings, our_name=our_name)
        worst = deviations[0] if deviations else None
    return ExportParity(
        prompts=len(images),
        prompt_tokens=ours.num_image_tokens + captions.shape[1],
        prompts_from=images_from,
        max_abs_logit_diff=diff,
        tolerance=tolerance,
        inputs="images",
        config_mismatches=mismatches,
        worst_tensor=worst,
    )


def load_back(
    checkpoints: CheckpointManager, step: int, card: ModelCard, folder: Path, images: torch.Tensor,
    captions: torch.Tensor, images_from: str,
) -> ExportParity:  # fmt: skip
    """The written `folder` against checkpoint `step`'s model; ExportParityError naming the config field or the
    largest-deviating tensor when transformers' logits are not ours."""
    check_exportable(card.model)
    ours = VisionLanguageModel(card.model)
    checkpoints.load_model(step, ours)
    parity = check_vlm_export(folder, ours.eval(), card, images, captions, images_from)
    del ours
    require_parity(parity, f"checkpoint step {step}", WRITERS)
    return parity
