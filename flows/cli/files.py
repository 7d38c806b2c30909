"""`tdeploy render` and `tdeploy schema`: the files a deployment generates, and the spec's JSON Schema, written
without touching a cluster."""

from __future__ import annotations

from pathlib import Path

import typer

from flows.cli.common import SPEC_HELP, console, example, load

app = typer.Typer()


@app.command(epilog=example("tdeploy render examples/slurm.yaml --out rendered/slurm"))
def render(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    out: Path = typer.Option(Path("rendered"), "--out", help="Folder to write into (made fresh; RENDERED.md lists "
                             "what is there)."),  # fmt: skip
) -> None:
    """Write every file the deployment would generate (run.json, the sbatch script or Kubernetes manifests, the
    Containerfile, the Ansible inventory and extravars, the serving manifests), each checked as its step checks it."""
    from tasks.rendered import INDEX_FILE, render_all, write_rendering

    rendering = render_all(load(spec, check_paths=False))
    write_rendering(rendering, out)
    for file in rendering.files:
        console.print(f"{out / file.name}: {file.what} ({file.checked})", markup=False, highlight=False)
    for note in rendering.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    console.print(f"index: {out / INDEX_FILE}", markup=False, highlight=False)


@app.command(epilog=example("tdeploy schema --out examples/spec.schema.json"))
def schema(
    out: Path | None = typer.Option(None, "--out", help="File to write (default: standard output)."),
) -> None:
    """Write the deployment spec's JSON Schema, for editors (yaml-language-server) and CI checks of specs."""
    from tasks.spec_schema import schema_text

    text = schema_text()
    if out is None:
        console.out(text, end="", highlight=False)
        return
    tmp = out.with_name(f".{out.name}.partial")
    tmp.write_text(text)
    tmp.replace(out)
    console.print(f"wrote {out}", markup=False, highlight=False)
