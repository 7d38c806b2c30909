"""A ViT classifier checkpoint as a Hugging Face `ViTForImageClassification` folder, with its image processor.

The payload's VisionTransformer (training/vision.py, `model.kind: vit`) is Hugging Face's ViT block for block: a
bias-carrying Conv2d patch embedding, a class token, learned position embeddings, pre-norm blocks with LayerNorm,
biased q/k/v/o projections and an exact (erf) GELU MLP, a final LayerNorm and a linear head on the class token. So
the export renames tensors (`_NAMES`, one table both ways) and writes:

- config.json: ViTConfig (`hidden_act: gelu`, `qkv_bias: true`, dropout 0, id2label/label2id from the dataset's
  class names, which the image dataset's manifest records);
- model.safetensors (or shards and an index, as the language model's export cuts them) under the names the Hub's
  ViT checkpoints use (`vit.encoder.layer.<i>.attention.attention.query`, ...), which transformers 5 renames to
  its own on load;
- preprocessor_config.json: ViTImageProcessor resizing to image_size (bilinear), rescaling by 1/255 and normalising
  with mean = std = 0.5, the model's own first operation (training/vision.py), so raw images give our logits.

At export time the folder is loaded the way its users load it (AutoImageProcessor on PIL images, then
AutoModelForImageClassification in fp32 on CPU) and its logits on held-out images are compared with our model's
on the same uint8 pixels (`check_vit_export`); a mismatch names the config field or the largest-deviating tensor
and nothing is published (tasks/export/parity.py ExportParityError).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tasks.export.hf import CONFIG, WEIGHTS_INDEX, ExportError, WeightsWritten, plan_named_shards, shard_name
from tasks.export.parity import ExportParity, require_parity, tensor_deviations
from training import hf_vision_names
from training.image_dataset import ImageDataset, ImageDatasetError, read_image_manifest
from training.vision import VisionTransformer

if TYPE_CHECKING:
    from training.checkpoint import CheckpointManager, TensorInfo
    from training.config import ModelConfig, VisionConfig
    from training.storage import StorageConfig

ARCHITECTURE = "ViTForImageClassification"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
PIL_BILINEAR = 2  # PIL.Image.Resampling.BILINEAR, as transformers' image processors record `resample`
PIXEL_MEAN = 0.5  # training/vision.py normalises x/255 to (x - 0.5) / 0.5 per channel
PIXEL_STD = 0.5
PARITY_IMAGES = 8
PARITY_SEED = 0
# Both sides in fp32 on the same uint8 pixels: the image processor's rescale and normalisation give exactly the
# model's own (x/255 - 0.5)/0.5 (measured: 0.0 on random images), and transformers' ViT runs the same operations
# in the same order (Conv2d, LayerNorm, SDPA, Linear, erf GELU). Measured max |logit diff| on the test models: 0.0
# (tests/integration/test_vit_export.py, random weights with init std 0.02 and 0.5). A wrong tensor moves them by
# orders of magnitude more (0.01 added to one MLP weight: over 100x the tolerance). The tolerance is fp32 rounding
# (1e-6 and 1e-6 of the largest logit), room for a kernel that sums in another order on another CPU.
PARITY_ATOL = 1e-6
PARITY_RTOL = 1e-6
WRITERS = "the ViT name table or config writer in tasks/export/vit.py"

# (our name, the Hugging Face ViTForImageClassification name): the shared table (training/hf_vision_names.py).
_TABLE: tuple[tuple[str, str], ...] = (
    hf_vision_names.prefixed(hf_vision_names.VIT, "", "vit.") + hf_vision_names.VIT_HEAD
)
_pattern = hf_vision_names.pattern


_NAMES = tuple((_pattern(ours), theirs) for ours, theirs in _TABLE)
_REVERSE = tuple((_pattern(theirs), ours) for ours, theirs in _TABLE)
"""Built once at import: a fault that patches `_NAMES` for the export is found by the load-back check, which maps
the written names back with this one."""


def hf_name(name: str) -> str:
    """The ViTForImageClassification name of our VisionTransformer parameter `name`; ExportError for another."""
    for pattern, theirs in _NAMES:
        match = pattern.fullmatch(name)
        if match:
            return theirs.format(**match.groupdict())
    raise ExportError(
        "tensor",
        name,
        "is not a parameter of training/vision.py's VisionTransformer, so it has no ViT name",
        "export a checkpoint this trainer saved (or add the name to tasks/export/vit.py _TABLE)",
    )


def our_name(name: str) -> str:
    """Our VisionTransformer name of the ViTForImageClassification tensor `name`; ValueError for another."""
    for pattern, ours in _REVERSE:
        match = pattern.fullmatch(name)
        if match:
            return ours.format(**match.groupdict())
    raise ValueError(f"{name}: not a ViTForImageClassification tensor name that tasks/export/vit.py writes")


def unexportable(model: ModelConfig) -> list[ExportError]:
    """What ViTForImageClassification cannot express of `model` ([] when it exports)."""
    if model.kind != "vit":
        return [
            ExportError(
                "model.kind",
                model.kind,
                "is not a ViT classifier: tasks/export/vit.py writes ViTForImageClassification only",
                "export it with tasks/export/step.py export_checkpoint (tdeploy export), which picks the exporter "
                "by model.kind",
            )
        ]
    vision = model.vision
    assert vision is not None, "ModelConfig validates that kind vit has a vision section"
    problems = []
    if vision.pooling != "cls":
        problems.append(
            ExportError(
                "model.vision.pooling",
                vision.pooling,
                "ViTForImageClassification classifies the class token's final state; a mean-pooled head has no "
                "equivalent there, so its logits could not match",
                "train the classifier with model.vision.pooling: cls to export it",
            )
        )
    if vision.num_classes is None:
        problems.append(
            ExportError(
                "model.vision.num_classes",
                None,
                "a ViT without a classification head",
                "set model.vision.num_classes to the dataset's class count and train the classifier",
            )
        )
    return problems


def check_exportable(model: ModelConfig) -> VisionConfig:
    """The vision section of `model` when ViTForImageClassification expresses it; else the first problem."""
    problems = unexportable(model)
    if problems:
        raise problems[0]
    assert model.vision is not None
    return model.vision


def vit_config(model: ModelConfig, class_names: list[str], dtype: str = "float32") -> dict[str, Any]:
    """config.json (ViTConfig) of `model` with the dataset's `class_names` as labels; `dtype` into torch_dtype."""
    vision = check_exportable(model)
    if len(class_names) != vision.num_classes:
        raise ExportError(
            "model.vision.num_classes",
            vision.num_classes,
            f"the dataset names {len(class_names)} classes ({', '.join(class_names[:4])}"
            f"{', ...' if len(class_names) > 4 else ''})",
            "export with the dataset the classifier was trained on (its IMAGES.json class_names)",
        )
    if len(set(class_names)) != len(class_names):
        raise ExportError(
            "class_names", class_names, "holds a name twice, so label2id cannot map names back to ids",
            "prepare the dataset again with distinct class names",
        )  # fmt: skip
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "vit",
        "hidden_size": vision.d_model,
        "num_hidden_layers": vision.n_layers,
        "num_attention_heads": vision.n_heads,
        "intermediate_size": vision.ffn_hidden,
        "hidden_act": "gelu",  # transformers' "gelu" is the exact erf GELU, as training/vision.py's
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02,
        "layer_norm_eps": vision.norm_eps,
        "image_size": vision.image_size,
        "patch_size": vision.patch_size,
        "num_channels": vision.channels,
        "qkv_bias": True,
        "encoder_stride": vision.patch_size,
        "id2label": {str(i): name for i, name in enumerate(class_names)},
        "label2id": {name: i for i, name in enumerate(class_names)},
        "problem_type": "single_label_classification",
        "torch_dtype": dtype,
        "dtype": dtype,  # transformers >= 5 spells torch_dtype so
    }


def preprocessor_config(vision: VisionConfig) -> dict[str, Any]:
    """preprocessor_config.json: the ViTImageProcessor that turns an image into our model's input."""
    return {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": vision.image_size, "width": vision.image_size},
        "resample": PIL_BILINEAR,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [PIXEL_MEAN] * vision.channels,
        "image_std": [PIXEL_STD] * vision.channels,
    }


def expected_tensors(vision: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes of the classifier, from the model built on the meta device."""
    with torch.device("meta"):
        built = VisionTransformer(vision, vision.num_classes)
    return {name: tuple(param.shape) for name, param in built.named_parameters()}


def _plan(
    tensors: dict[str, TensorInfo], vision: VisionConfig, max_shard_bytes: int
) -> list[list[tuple[str, str, TensorInfo]]]:
    """(our name, theirs, info) cut into files of at most `max_shard_bytes`; ExportError when the checkpoint does
    not hold exactly the classifier's parameters."""
    return plan_named_shards(
        tensors, expected_tensors(vision), hf_name, f"its ViT ({vision.n_layers} layers)", max_shard_bytes
    )


def export_vit_weights(
    checkpoints: CheckpointManager, step: int, vision: VisionConfig, out_dir: Path, max_shard_bytes: int
) -> WeightsWritten:
    """The classifier's weights of checkpoint `step` into `out_dir` as safetensors under the ViT names (sharded
    above `max_shard_bytes`, with the index), one shard in memory at a time."""
    from safetensors.torch import save_file

    shards = _plan(checkpoints.model_tensors(step), vision, max_shard_bytes)
    files, weight_map, n_params, total = [], {}, 0, 0
    for index, shard in enumerate(shards):
        name = shard_name(index, len(shards))
        loaded = checkpoints.load_model_tensors(step, {ours: info for ours, _, info in shard})
        tensors = {theirs: loaded.pop(ours).contiguous() for ours, theirs, _ in shard}
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        for theirs, tensor in tensors.items():
            weight_map[theirs] = name
            n_params += tensor.numel()
            total += tensor.numel() * tensor.element_size()
        files.append(name)
        del tensors, loaded
    if len(shards) > 1:
        index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / WEIGHTS_INDEX).write_text(json.dumps(index_doc, indent=2))
        files.append(WEIGHTS_INDEX)
    return WeightsWritten(files, n_params, total)


def write_vit_configs(model: ModelConfig, class_names: list[str], out_dir: Path, dtype: str) -> list[str]:
    """config.json and preprocessor_config.json into `out_dir`; the files."""
    (out_dir / CONFIG).write_text(json.dumps(vit_config(model, class_names, dtype), indent=2))
    (out_dir / PREPROCESSOR_CONFIG).write_text(json.dumps(preprocessor_config(check_exportable(model)), indent=2))
    return [CONFIG, PREPROCESSOR_CONFIG]


# ---- the dataset's side: class names and held-out images --------------------------------------------------------


def class_names(dataset_url: str, storage: StorageConfig, num_classes: int) -> tuple[list[str], list[str]]:
    """The class names of the image dataset the classifier trained on (its IMAGES.json), and notes: a dataset that
    records none gives the ids as names, and says so. ExportError when the manifest cannot be read or is not a
    labelled dataset of `num_classes` classes."""
    try:
        manifest = read_image_manifest(dataset_url, storage)
    except (ImageDatasetError, OSError) as err:
        raise ExportError(
            "data.dataset_url",
            dataset_url,
            f"the image dataset's manifest, which names the classes for config.json's id2label, cannot be read: {err}",
            "export where the run's prepared image dataset is readable (restore it, or set the storage options)",
        ) from err
    if manifest.kind != "labels" or manifest.num_classes != num_classes:
        raise ExportError(
            "data.dataset_url", dataset_url,
            f"is a {manifest.kind} dataset of {manifest.num_classes} classes; the classifier has {num_classes}",
            "export the classifier with the labelled dataset it was trained on",
        )  # fmt: skip
    if manifest.class_names:
        return list(manifest.class_names), []
    note = f"{dataset_url} records no class names: config.json's id2label names each class by its id"
    return [str(i) for i in range(num_classes)], [note]


def parity_images(
    dataset_url: str, storage: StorageConfig, val_split: str, train_split: str, vision: VisionConfig
) -> tuple[torch.Tensor, str]:
    """PARITY_IMAGES uint8 images (B, C, H, W) spread over the dataset's held-out split (the training split when it
    has none); fixed random pixels where the dataset holds none of the model's size. Also says where they came from."""
    try:
        manifest = read_image_manifest(dataset_url, storage)
        split = val_split if val_split in manifest.splits else train_split
        if manifest.image_size != vision.image_size:
            why = f"its images are {manifest.image_size} px, the model's {vision.image_size} px"
        else:
            data = ImageDataset(dataset_url, split, storage, expect_kind="labels")
            if len(data) > 0:
                count = min(PARITY_IMAGES, len(data))
                stride = max(1, len(data) // count)
                images = data.batch([(k * stride) % len(data) for k in range(count)]).images
                return images, f"split {split!r} of {dataset_url}"
            why = f"split {split!r} of {dataset_url} holds no image"
    except (ImageDatasetError, OSError) as err:
        why = f"the dataset {dataset_url} cannot be read here: {err}"
    generator = torch.Generator().manual_seed(PARITY_SEED)
    shape = (PARITY_IMAGES, vision.channels, vision.image_size, vision.image_size)
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8), f"random pixels (seed {PARITY_SEED}): {why}"


# ---- the load-back check ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Field:
    name: str
    ours: Any
    theirs: Any


def _config_fields(vision: VisionConfig, class_names: list[str], config: Any, processor: Any) -> list[_Field]:
    """The function-changing fields of the folder as transformers read them, beside the trained values."""
    size = getattr(processor, "size", None) or {}
    return [
        _Field("hidden_size", vision.d_model, config.hidden_size),
        _Field("intermediate_size", vision.ffn_hidden, config.intermediate_size),
        _Field("num_hidden_layers", vision.n_layers, config.num_hidden_layers),
        _Field("num_attention_heads", vision.n_heads, config.num_attention_heads),
        _Field("hidden_act", "gelu", config.hidden_act),
        _Field("layer_norm_eps", vision.norm_eps, config.layer_norm_eps),
        _Field("image_size", vision.image_size, config.image_size),
        _Field("patch_size", vision.patch_size, config.patch_size),
        _Field("num_channels", vision.channels, config.num_channels),
        _Field("qkv_bias", True, config.qkv_bias),
        _Field("id2label", dict(enumerate(class_names)), {int(k): v for k, v in config.id2label.items()}),
        _Field("preprocessor size", [vision.image_size] * 2, [size.get("height"), size.get("width")]),
        _Field("preprocessor rescale_factor", 1 / 255, getattr(processor, "rescale_factor", None)),
        _Field("preprocessor image_mean", [PIXEL_MEAN] * vision.channels, list(processor.image_mean or [])),
        _Field("preprocessor image_std", [PIXEL_STD] * vision.channels, list(processor.image_std or [])),
    ]


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) and isinstance(theirs, int | float):
        return abs(ours - float(theirs)) <= 1e-12 * max(1.0, abs(ours))
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return all(_same(a, b) for a, b in zip(ours, theirs, strict=True))
    return bool(ours == theirs)


def _pil(images: torch.Tensor) -> list[Any]:
    """uint8 (B, C, H, W) as PIL images, as a user hands them to the image processor."""
    from PIL import Image

    arrays = images.permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in arrays]


def transformers_logits(folder: Path, images: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
    """The logits of the folder on `images` (uint8) as its users get them: AutoImageProcessor on PIL images, then
    AutoModelForImageClassification in fp32 on CPU, no remote code; and the model's config and the processor."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    processor = transformers.AutoImageProcessor.from_pretrained(str(folder))
    pixels = processor(images=_pil(images), return_tensors="pt")["pixel_values"]
    loaded = transformers.AutoModelForImageClassification.from_pretrained(
        str(folder), dtype=torch.float32, trust_remote_code=False, device_map=None
    ).eval()
    with torch.no_grad():
        logits = loaded(pixel_values=pixels).logits.float()
    config = loaded.config
    del loaded
    return logits, config, processor


def check_vit_export(
    folder: Path, ours: torch.nn.Module, vision: VisionConfig, class_names: list[str], images: torch.Tensor,
    images_from: str,
) -> ExportParity:  # fmt: skip
    """Load `folder` with transformers and compare its logits on `images` with `ours` (the checkpoint's
    VisionTransformer, fp32, eval) on the same pixels; the finding, not yet judged (`require_parity`)."""
    theirs, config, processor = transformers_logits(folder, images)
    with torch.no_grad():
        expected = ours(images).float()
    diff = (theirs - expected).abs().max().item() if theirs.shape == expected.shape else float("inf")
    tolerance = PARITY_ATOL + PARITY_RTOL * expected.abs().max().item()
    mismatches = [
        f"{f.name}: {f.theirs!r} in the folder (as transformers reads it) vs {f.ours!r} trained"
        for f in _config_fields(vision, class_names, config, processor)
        if not _same(f.ours, f.theirs)
    ]
    worst = None
    if diff > tolerance or mismatches:
        state = {name: tensor.detach() for name, tensor in ours.state_dict().items()}
        deviations = tensor_deviations(folder, state, tied=False, our_name=our_name)
        worst = deviations[0] if deviations else None
    return ExportParity(
        prompts=len(images),
        prompt_tokens=vision.n_tokens,
        prompts_from=images_from,
        max_abs_logit_diff=diff,
        tolerance=tolerance,
        inputs="images",
        config_mismatches=mismatches,
        worst_tensor=worst,
    )


def load_back(
    checkpoints: CheckpointManager, step: int, model: ModelConfig, class_names: list[str], folder: Path,
    images: torch.Tensor, images_from: str,
) -> ExportParity:  # fmt: skip
    """The written `folder` against checkpoint `step`'s classifier; ExportParityError naming the config field or
    the largest-deviating tensor when transformers' logits are not ours."""
    vision = check_exportable(model)
    ours = VisionTransformer(vision, vision.num_classes)
    checkpoints.load_model(step, ours)
    parity = check_vit_export(folder, ours.eval(), vision, class_names, images, images_from)
    del ours
    require_parity(parity, f"checkpoint step {step}", WRITERS)
    return parity
