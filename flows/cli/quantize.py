"""`tdeploy quantize`: the exported model quantized with LLM Compressor and gated against the unquantized one."""

from __future__ import annotations

from pathlib import Path

import typer

from flows.cli.common import EXIT_FAILED_CHECK, EXIT_USER_ERROR, SPEC_HELP, console, err_console, example, load
from flows.cli.data import model_card_figures, training_config_prepared

app = typer.Typer()


@app.command(
    epilog=example("tdeploy quantize examples/quantized.yaml", "tdeploy quantize examples/quantized.yaml --step 40")
)
def quantize(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    step: int | None = typer.Option(
        None, "--step", min=0, help="Checkpoint step to export and quantize; default the newest sound one."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Folder for quantization.json and the servers' logs; default runs/<name>/quantize."
    ),
) -> None:
    """Export a checkpoint, quantize it (the spec's quantize section), serve both with vLLM and gate the quantized
    model: perplexity and greedy agreement within bounds; memory, P99 and throughput against the unquantized one.
    Exit 1 when it misses a bound."""
    from tasks.quantize.gate import table_rows
    from tasks.quantize.step import QuantizationGateFailed, QuantizeInputs, run

    if load(spec, check_paths=False).quantize is None:  # said before the paths are checked
        err_console.print("the spec has no quantize section; add `quantize: {}` (and `serve: {}`)", markup=False)
        raise typer.Exit(EXIT_USER_ERROR)
    parsed = load(spec)
    inputs = QuantizeInputs.of(parsed, training_config_prepared(parsed), str(out) if out else None, step,
                               model_card_figures(parsed))

    def show(report) -> None:  # noqa: ANN001 - tasks.quantize.gate.QuantizationReport
        for row in table_rows(report):
            console.print(f"{row['check']}: {row['verdict']} ({row['message']})", markup=False, highlight=False)
        console.print(f"quantized {report.quantized.model_dir}\nreport {report.files['json']}", markup=False,
                      highlight=False)  # fmt: skip

    try:
        run(inputs, show)
    except QuantizationGateFailed:  # the table said which figure missed
        raise typer.Exit(EXIT_FAILED_CHECK) from None
