"""Quantize an exported model folder into a sibling folder, atomically, with LLM Compressor in .venv-quant.

The quantized folder is written as `.partial-<name>-*` beside its final place and renamed when complete, with
QUANTIZE.json (the source export, the scheme and the sha256 of every other file) written last: a folder
without QUANTIZE.json is not a finished quantization, as a folder without EXPORT.json is not a finished export.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import UserError
from tasks.paths import EXPORT_RECORD, QUANTIZE_RECORD
from tasks.quantize.config import QuantizeConfig

REPO = Path(__file__).resolve().parents[2]
QUANT_PYTHON_ENV = "TDEPLOY_QUANT_PYTHON"
"""Names the Python of an environment with LLM Compressor; default <repo>/.venv-quant/bin/python."""
WORKER = Path(__file__).with_name("llmc_worker.py")
PARTIAL_PREFIX = ".partial-"
QUANTIZE_LOG = "quantize.log"
QUANTIZE_VERSION = 1


class QuantizeFailed(UserError):
    """LLM Compressor failed on the model (its log says why)."""


@dataclass(frozen=True)
class QuantizedFolder:
    """A finished quantization: where, of what, how big."""

    model_dir: str
    source_dir: str
    scheme: str
    method: str
    bytes: int
    """Bytes of the weight files (*.safetensors)."""
    source_bytes: int
    seconds: float


def quant_python() -> Path:
    """The Python that runs LLM Compressor: $TDEPLOY_QUANT_PYTHON, else <repo>/.venv-quant/bin/python."""
    given = os.environ.get(QUANT_PYTHON_ENV)
    python = Path(given) if given else REPO / ".venv-quant" / "bin" / "python"
    if not (python.is_file() and os.access(python, os.X_OK)):
        where = f"{QUANT_PYTHON_ENV}={given}" if given else f"the quantization environment's Python {python}"
        raise UserError(
            f"{where} does not exist or cannot be run",
            "run `bash .ci/setup` (it makes .venv-quant with LLM Compressor) or set "
            f"{QUANT_PYTHON_ENV} to the Python of an environment that has llmcompressor",
        )
    return python


def quantized_folder_name(export_dir: Path, cfg: QuantizeConfig) -> str:
    """The quantized sibling of an export folder: step-<N>-<scheme>-<method> (lower case)."""
    return f"{export_dir.name}-{cfg.scheme.lower()}-{cfg.method}"


def weight_bytes(folder: Path) -> int:
    """Bytes of a model folder's *.safetensors files."""
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_record(folder: Path) -> dict | None:
    """QUANTIZE.json of a finished quantized folder (None: not one)."""
    path = folder / QUANTIZE_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def quantize_folder(
    src: Path, cfg: QuantizeConfig, calibration: list[list[int]], dst: Path | None = None, log_dir: Path | None = None
) -> QuantizedFolder:
    """Quantize the finished export `src` into `dst` (default: its sibling `quantized_folder_name`), replacing an
    earlier quantization there; `calibration`: the held-out token ids GPTQ calibrates on. The worker's output
    goes to <log_dir>/quantize.log (default: beside the folder)."""
    if not (src / EXPORT_RECORD).is_file():
        raise UserError(
            f"{src}: no {EXPORT_RECORD}; not a finished export", "export the checkpoint first (tdeploy export SPEC)"
        )
    final = dst or src.with_name(quantized_folder_name(src, cfg))
    if final.exists() and any(final.iterdir()) and read_record(final) is None:
        raise UserError(
            f"{final}: exists and is not a quantized folder (no {QUANTIZE_RECORD}); a quantization replaces only an "
            "earlier one",
            "remove it, or quantize into another folder",
        )
    python = quant_python()
    final.parent.mkdir(parents=True, exist_ok=True)
    log_path = (log_dir or final.parent) / QUANTIZE_LOG
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=f"{PARTIAL_PREFIX}{final.name}-", dir=final.parent))
    try:
        folder = staging / "model"
        request = staging / "request.json"
        request.write_text(json.dumps({
            "src": str(src.resolve()), "dst": str(folder), "scheme": cfg.scheme, "method": cfg.method,
            "calibration": calibration,
        }))  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        with log_path.open("wb") as out:
            proc = subprocess.run(  # noqa: S603 - argv of paths this module made, no shell
                [str(python), str(WORKER), str(request)], stdout=out, stderr=subprocess.STDOUT, env=env, check=False
            )
        if proc.returncode != 0 or not (folder / "config.json").is_file():
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise QuantizeFailed(
                f"quantize.scheme={cfg.scheme} method={cfg.method}: LLM Compressor exited with {proc.returncode} "
                f"on {src}:\n{tail}",
                f"see {log_path}",
            )
        files = sorted(p.name for p in folder.iterdir() if p.is_file())
        record = {
            "format_version": QUANTIZE_VERSION,
            "source": {"model_dir": str(src.resolve()), "export_sha256": _sha256(src / EXPORT_RECORD)},
            "scheme": cfg.scheme,
            "method": cfg.method,
            "calibration_samples": len(calibration),
            "quantized_unix_s": time.time(),
            "files": {name: {"sha256": _sha256(folder / name), "bytes": (folder / name).stat().st_size}
                      for name in files},
        }  # fmt: skip
        (folder / QUANTIZE_RECORD).write_text(json.dumps(record, indent=2))
        _replace(folder, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return QuantizedFolder(
        model_dir=str(final), source_dir=str(src), scheme=cfg.scheme, method=cfg.method, bytes=weight_bytes(final),
        source_bytes=weight_bytes(src), seconds=time.monotonic() - started,
    )  # fmt: skip


def _replace(folder: Path, final: Path) -> None:
    """Put the finished `folder` in place of `final` (an earlier quantization there goes)."""
    if not final.exists():
        folder.rename(final)
        return
    old = final.with_name(f"{PARTIAL_PREFIX}old-{final.name}-{time.time_ns()}")
    final.rename(old)
    folder.rename(final)
    shutil.rmtree(old, ignore_errors=True)
