"""Image build wall times with buildah: cold build, warm no-op (cache hit), rebuild after a one-line payload change.

Runs in a private buildah store (vfs driver, chroot isolation, no pulls) in a
temporary folder, on the small local base image the integration tests use
(busybox + this machine's Python 3.11 + pip), since no public registry is
reachable here. Goals: the no-op is under 2 s; a payload-only change rebuilds
only the payload layers (the wheel copy and its install), every other layer
comes from the cache.

Usage: python benchmarks/image_build.py [--noop-repeats 5] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tasks.image.build import ImageResult, ensure_image
from tasks.image.payload import payload_source

# The base image and the test image settings are the integration tests' own (tests/ is not installed).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.image.conftest import image_config, make_python_base  # noqa: E402


def layers(store: Path, reference: str) -> list[str]:
    """Layer digests of an image in the store, base first."""
    cmd = ["buildah", "--storage-driver", "vfs", "--root", str(store / "storage"), "--runroot", str(store / "run")]
    out = subprocess.run([*cmd, "inspect", "--type", "image", reference], capture_output=True, text=True, check=True)
    return [layer["digest"] for layer in json.loads(json.loads(out.stdout)["Manifest"])["layers"]]


def timed(store: Path, record: Path, source: Path) -> tuple[float, ImageResult]:
    """Wall time of one `ensure_image` call."""
    started = time.perf_counter()
    result = ensure_image(image_config(store), record, source=source)
    return time.perf_counter() - started, result


def main() -> None:
    """Run the three measurements and print a table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noop-repeats", type=int, default=5, help="Warm no-op runs (median and max reported).")
    parser.add_argument(
        "--keep", type=Path, default=None, help="Work in this folder and keep it (default: a temp dir)."
    )
    args = parser.parse_args()

    work = args.keep or Path(tempfile.mkdtemp(prefix="tdeploy-image-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    store = work / "store"
    source = work / "src" / "training"
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(source.parent, ignore_errors=True)
    shutil.copytree(payload_source(), source, ignore=shutil.ignore_patterns("__pycache__"))
    try:
        started = time.perf_counter()
        make_python_base(store)
        base_s = time.perf_counter() - started

        cold_s, cold = timed(store, work / "record", source)
        assert cold.status == "built", cold.reason
        noops = [timed(store, work / "record", source) for _ in range(args.noop_repeats)]
        assert all(r.status == "cached" and r.image_id == cold.image_id for _, r in noops)

        with (source / "__init__.py").open("a") as handle:
            handle.write("BENCHMARK_EDIT = 1\n")
        change_s, changed = timed(store, work / "record", source)
        assert changed.status == "built" and changed.tag != cold.tag, changed.reason
        before, after = layers(store, cold.reference or ""), layers(store, changed.reference or "")
        new_layers = sum(b != a for b, a in zip(before, after, strict=True))

        noop_times = [t for t, _ in noops]
        mib = (cold.size_bytes or 0) / 2**20
        print(f"base image (busybox + python3.11 + pip, not counted): {base_s:.1f} s; image {mib:.1f} MiB")
        print(f"{'measurement':<34}{'wall s':>9}  notes")
        print(f"{'cold build':<34}{cold_s:>9.2f}  {cold.steps} steps, {cold.cached_steps} cached; tag {cold.tag}")
        print(
            f"{'warm no-op (cache hit)':<34}{statistics.median(noop_times):>9.2f}  "
            f"median of {len(noop_times)}, max {max(noop_times):.2f} s (goal < 2 s: "
            f"{'met' if max(noop_times) < 2 else 'MISSED'})"
        )
        print(
            f"{'one-line payload change':<34}{change_s:>9.2f}  {changed.cached_steps}/{changed.steps} steps cached; "
            f"{new_layers} of {len(after)} layers new (payload layers: 2: "
            f"{'met' if new_layers == 2 and before[:-2] == after[:-2] else 'MISSED'})"
        )
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
