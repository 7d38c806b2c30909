"""`tdeploy export`, `serve` and `check-serving`: a checkpoint as a Hugging Face model folder, served as its model
kind is served (vLLM; the classifier server for a ViT), and the pipeline's serving check."""

from __future__ import annotations

from pathlib import Path

import typer

from flows.cli.common import EXIT_FAILED_CHECK, EXIT_USER_ERROR, SPEC_HELP, console, err_console, example, load
from flows.cli.data import model_card_figures, training_config_prepared

app = typer.Typer()


@app.command(
    epilog=example(
        "tdeploy export examples/local.yaml",
        "tdeploy export examples/local.yaml --step 20 --out runs/local/hf",
        "tdeploy export examples/local.yaml --format onnx",
    )
)
def export(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    step: int | None = typer.Option(
        None, "--step", min=0, help="Checkpoint step to export; default the newest sound one."
    ),
    out: str | None = typer.Option(
        None,
        "--out",
        help="Model folder to write (a local folder or an fsspec URL); default <deployment_dir>/export/step-<N>.",
    ),
    tokenizer: str | None = typer.Option(
        None,
        "--tokenizer",
        help="tokenizer.json (path or fsspec URL) for a run trained on adopted token ids without one "
        "(data.tokenizer_url unset); other runs ship their dataset's tokenizer.",
    ),
    export_format: str = typer.Option(
        "hf",
        "--format",
        help="hf: a Hugging Face folder; onnx: that folder, then its ONNX Runtime graphs for CPU and edge inference "
        "(fp32 and int8, each with its parity) in the local folders --out and <--out>-int8 (default <deployment_dir>/"
        "export/step-<N>-onnx and step-<N>-onnx-int8; the Hugging Face folder goes to its default place).",
    ),
) -> None:
    """Export a checkpoint as a Hugging Face model folder (config, safetensors, tokenizer) for transformers or vLLM,
    or also as ONNX (--format onnx)."""
    from tasks.export.onnx import check_format, run_onnx
    from tasks.export.step import ExportInputs, run

    check_format(export_format)
    parsed = load(spec)
    cfg = training_config_prepared(parsed, validate_data=False)  # the checkpoint's commit vouches for its data
    if export_format == "onnx":
        result, onnx = run_onnx(ExportInputs.of(parsed, cfg, step, None, tokenizer, model_card_figures(parsed)), out)
    else:
        result, onnx = run(ExportInputs.of(parsed, cfg, step, out, tokenizer, model_card_figures(parsed))), None
    console.print(f"exported {result.summary()}", markup=False, highlight=False)
    console.print(f"from {result.checkpoint_dir}", markup=False, highlight=False)
    for name in result.files:
        console.print(f"  {name}", markup=False, highlight=False)
    for note in result.notes:
        err_console.print(f"note: {note}", style="yellow", markup=False, highlight=False)
    for variant in onnx.variants if onnx is not None else []:
        console.print(f"ONNX {variant.precision}: {variant.model_dir} ({variant.bytes / 1e6:.1f} MB); parity "
                      f"{variant.parity.describe()}", markup=False, highlight=False)  # fmt: skip


@app.command(
    epilog=example(
        "tdeploy serve examples/local.yaml",
        "tdeploy serve examples/local.yaml --step 20",
        "tdeploy serve examples/local.yaml --model-dir runs/local/export/step-20",
    )
)
def serve(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    step: int | None = typer.Option(
        None, "--step", min=0, help="Checkpoint step to export and serve; default the newest sound one."
    ),
    model_dir: Path | None = typer.Option(
        None, "--model-dir", help="Serve this Hugging Face model folder as it is, without exporting a checkpoint."
    ),
) -> None:
    """Export a checkpoint and serve it until Ctrl-C or SIGTERM with the server the serving check starts for its
    model kind: vLLM's OpenAI-compatible server (a vision-language model with its image flags), or the classifier
    server for a ViT (model.kind vit)."""
    import signal

    from tasks.paths import DeploymentPaths
    from tasks.serve.server import SERVER_LOG, log_tail
    from tasks.serve.step import SERVED_KINDS, start_model_server
    from training.storage import is_local, local_path

    parsed = load(spec)  # a model the serve section cannot serve is refused here, with the fix
    if parsed.serve is None:
        err_console.print("the spec has no serve section: serving is off; add `serve: {}` to serve", markup=False)
        raise typer.Exit(EXIT_USER_ERROR)
    if step is not None and model_dir is not None:
        err_console.print("--step exports a checkpoint, --model-dir serves a folder as it is: give one", markup=False)
        raise typer.Exit(EXIT_USER_ERROR)
    if model_dir is None:
        from tasks.export.step import ExportInputs
        from tasks.export.step import run as export_step

        cfg = training_config_prepared(parsed, validate_data=False)  # the checkpoint's commit vouches for its data
        result = export_step(ExportInputs.of(parsed, cfg, step, acceptance=model_card_figures(parsed)))
        console.print(f"exported {result.summary()}", markup=False, highlight=False)
        if not is_local(result.model_dir):
            err_console.print(f"{result.model_dir}: the server serves a local folder; export to one", markup=False)
            raise typer.Exit(EXIT_USER_ERROR)
        model_dir = Path(local_path(result.model_dir))

    stopped_by = [signal.SIGINT]  # a KeyboardInterrupt before the handlers below are in place is a Ctrl-C

    def stop_on_signal(signum: int, frame: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):  # one stop at a time: Server.stop escalates by itself
            signal.signal(sig, signal.SIG_IGN)
        stopped_by[0] = signal.Signals(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # the serving check's folder and log name too
    log_path = Path(DeploymentPaths.of(parsed).serving_dir()) / SERVER_LOG
    served = SERVED_KINDS[parsed.model.kind]
    console.print(
        f"starting {served.server} on {model_dir} (log {log_path}; ready within serve.startup_timeout_s="
        f"{parsed.serve.startup_timeout_s:g})",
        markup=False,
        highlight=False,
    )
    previous = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = None
    try:
        server = start_model_server(
            parsed.model, model_dir, parsed.serve, parsed.name, log_path, parsed.cluster.accelerator,
            on_wait=lambda waited: console.print(f"waiting for {served.server}'s /health ({waited:.0f} s)"),
        )  # fmt: skip
        with server:
            console.print(
                f"serving {parsed.name} with {served.server} at {server.url} (pid {server.pid}); Ctrl-C stops it\n"
                f"  {served.endpoint}  {server.url}{served.endpoint_path} (model {parsed.name!r})\n"
                f"  metrics  {server.url}/metrics",
                markup=False,
                highlight=False,
            )
            code = server.wait()
        err_console.print(
            f"{served.server} (pid {server.pid}) exited with {code}; the last lines of {log_path}:\n"
            f"{log_tail(log_path)}",
            markup=False,
            highlight=False,
        )
        raise typer.Exit(EXIT_FAILED_CHECK)
    except KeyboardInterrupt:
        what = f"stopped {served.server} (pid {server.pid})" if server else f"stopped {served.server} before it served"
        console.print(f"{what} on {stopped_by[0].name}", markup=False, highlight=False)
        raise typer.Exit(128 + stopped_by[0]) from None  # as `tdeploy run`: 130 for Ctrl-C, 143 for SIGTERM
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@app.command(
    "check-serving",
    epilog=example(
        "tdeploy check-serving examples/local.yaml", "tdeploy check-serving examples/local.yaml --step 150",
        "tdeploy check-serving examples/local.yaml --step 20 --model-dir runs/local/export/step-20",
    ),
)
def check_serving(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    step: int | None = typer.Option(
        None, "--step", min=0, help="Checkpoint step to export and check; default the newest sound one."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Folder for serving.json and the rest; default runs/<name>/serving."
    ),
    model_dir: Path | None = typer.Option(
        None, "--model-dir", help="Check this model folder of checkpoint --step as it is, without exporting."
    ),
) -> None:
    """The pipeline's serving check of the model's kind: export, serve (vLLM, or the classifier server for a ViT),
    load-test, parity and quality (or accuracy and macro F1); exit 1 on a miss."""
    from tasks.serve.step import ServingCheckFailed, ServingInputs, run

    parsed = load(spec)
    if parsed.serve is None:
        err_console.print("the spec has no serve section: serving is off; add `serve: {}` to check it", markup=False)
        raise typer.Exit(EXIT_USER_ERROR)
    if model_dir is not None and step is None:
        err_console.print(f"--model-dir={model_dir} needs --step: the checkpoint step it was exported from (greedy "
                          "parity compares with our model of that step)", markup=False)  # fmt: skip
        raise typer.Exit(EXIT_USER_ERROR)
    from tasks.capacity.step import serving_pod_memory

    cfg = training_config_prepared(parsed, validate_data=False)  # the checkpoint's commit vouches for its data
    inputs = ServingInputs.of(parsed, cfg, str(out) if out else None, step,
                              model_dir=str(model_dir) if model_dir else None, acceptance=model_card_figures(parsed),
                              pod_memory_bytes=serving_pod_memory(parsed))  # fmt: skip
    try:
        run(inputs, _print_serving)
    except ServingCheckFailed:  # the table said which figure missed
        raise typer.Exit(EXIT_FAILED_CHECK) from None


def _print_serving(report) -> None:  # noqa: ANN001 - tasks.serve.step.ServingCheckReport
    """The check's table, a language model's parity chain, and the step's one-line result, for any model kind."""
    from tasks.serve.chain import chain_rows
    from tasks.serve.check import ServingReport
    from tasks.serve.report import table_rows
    from tasks.serve.step import result_of

    for row in table_rows(report):
        console.print(f"{row['check']}: {row['verdict']} ({row['message']})", markup=False, highlight=False)
    if isinstance(report, ServingReport):  # the vision kinds compare with transformers' or our model directly
        for row in chain_rows(report.chain):
            console.print(f"parity {row['hop']}, {row['measure']}: {row['measured']} {row['tolerance']} "
                          f"{row['verdict']} ({row['compared']})", markup=False, highlight=False)  # fmt: skip
    console.print(f"step {report.step} served from {report.model_dir}: {result_of(report).summary()}\n"
                  f"report {report.files['json']}", markup=False, highlight=False)  # fmt: skip
