"""Prefect task `export_model`: the export step's `run`, publishing what was written."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.errors import retry_on_transient
from tasks.export.step import ARTIFACT, ExportInputs, ExportResult, run


@task(name="export_model", retries=2, retry_delay_seconds=[5, 30], retry_condition_fn=retry_on_transient)
def export_model(inputs: ExportInputs) -> ExportResult:
    """Export a checkpoint as a Hugging Face model folder; publish what was written."""
    result = run(inputs)
    get_run_logger().info("export: %s", result.summary())
    rows = "\n".join(f"| `{name}` |" for name in result.files)
    notes = "".join(f"\n- note: {note}" for note in result.notes)
    if result.parity is not None:
        p = result.parity
        notes += (
            f"\n- load-time parity: transformers' logits within {p.max_abs_logit_diff:.2g} of the checkpoint's "
            f"(tolerance {p.tolerance:.2g}; {p.prompts} prompts of {p.prompt_tokens} tokens from {p.prompts_from})"
            f"\n- serve in: {result.serving_dtype}"
        )
    create_markdown_artifact(
        key=ARTIFACT,
        markdown=(
            f"# Export of step {result.step}\n\n- source: `{result.checkpoint_dir}`\n- model: "
            f"`{result.model_dir}` ({result.architecture}, {result.n_params:,} parameters, "
            f"{result.bytes / 1e6:.1f} MB){notes}\n\n| file |\n|---|\n{rows}\n"
        ),
        description=f"Hugging Face model folder of step {result.step}",
    )
    return result
