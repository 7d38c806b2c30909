"""Cold `.ci/setup --test` time: the setup of a base commit (pip) against the working tree's (uv), one after the other.

Each runs in a fresh clone with no .venv and with empty pip and uv caches, so that neither profits from the
other's downloads. The clones are removed afterwards.

    .venv/bin/python benchmarks/setup_time.py [--base COMMIT] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def clone(into: Path, setup_script: str) -> Path:
    """A clone of this repository's HEAD with `setup_script` as its .ci/setup."""
    subprocess.run(["git", "clone", "-q", str(REPO), str(into)], check=True)
    (into / ".ci" / "setup").write_text(setup_script)
    return into


def timed_setup(checkout: Path, caches: Path) -> tuple[float, str]:
    """Seconds that `bash .ci/setup --test` takes in `checkout`, and the end of its output."""
    env = dict(os.environ, PIP_CACHE_DIR=str(caches / "pip"), UV_CACHE_DIR=str(caches / "uv"))
    env.pop("VIRTUAL_ENV", None)
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", ".ci/setup", "--test"], cwd=checkout, env=env, capture_output=True, text=True, timeout=3600
    )
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"setup failed in {checkout}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    cuda = subprocess.run(
        [
            str(checkout / ".venv" / "bin" / "python"),
            "-c",
            "import torch; print(torch.__version__, torch.version.cuda)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return seconds, f"torch {cuda} (version, CUDA)\n" + "\n".join(proc.stdout.strip().splitlines()[-12:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base", default="0f605f1", help="the commit whose .ci/setup is 'before' (default: the last pip-only one)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the clones")
    args = parser.parse_args()
    before_script = subprocess.run(
        ["git", "show", f"{args.base}:.ci/setup"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    after_script = (REPO / ".ci" / "setup").read_text()
    work = Path(tempfile.mkdtemp(prefix="setup-bench-"))
    try:
        results = {}
        for name, script in (("before", before_script), ("after", after_script)):
            checkout = clone(work / name, script)
            seconds, tail = timed_setup(checkout, work / f"cache-{name}")
            results[name] = seconds
            print(f"== {name}: {seconds:.0f} s\n{tail}\n", flush=True)
        before, after = results["before"], results["after"]
        print(f"cold setup --test: before {before:.0f} s ({args.base}), after {after:.0f} s,", end=" ")
        print(f"{before / after:.1f}x faster")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
