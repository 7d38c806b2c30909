"""Throughput of the image data step against bare Pillow decoding and resizing of the same files, side by side.

`n_images` JPEG files (256x192, smooth random colour fields with noise, so that decoding does real work) are
written once into an ImageFolder of 4 classes. The bare side reads each file, decodes it with Pillow, converts
it to RGB, crops the centred square and resizes it to 64x64 (bicubic) in one thread: the least any preparation
must do. The step is `prepare_images` (tasks/prepare/images.py) over the same folder with one worker and
validation off: listing and fingerprinting the files, the same decoding (plus EXIF orientation), splitting and
writing the shards and IMAGES.json, into a fresh folder each round. Each round runs both sides back to back; the
median over `repeats` rounds of the ratio step / bare counts (the machine is shared). Printed beside them: the
step with two workers, and with the image suite on (its pHashes, Great Expectations suites and Data Docs).
Goal: ratio >= 0.8 with one worker.

Usage: python benchmarks/vision_data.py [--images 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
from PIL import Image

from tasks.prepare.config import PrepareConfig
from tasks.prepare.images import prepare_images
from training.storage import StorageConfig

SOURCE_PX = (256, 192)
IMAGE_SIZE = 64
CLASSES = 4


def write_source(root: Path, n_images: int, seed: int = 0) -> list[Path]:
    """n_images JPEGs under root/<class>/ (smooth colour fields with noise)."""
    rng = np.random.default_rng(seed)
    files = []
    width, height = SOURCE_PX
    for number in range(n_images):
        coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)).astype(int)
        noisy = np.clip(smooth + rng.integers(-12, 13, smooth.shape), 0, 255).astype(np.uint8)
        folder = root / f"class{number % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{number:06d}.jpg"
        Image.fromarray(noisy).save(path, quality=90)
        files.append(path)
    return files


def bare_pillow(files: list[Path]) -> float:
    """Seconds to read, decode, convert, centre-crop and resize every file with Pillow in one thread."""
    started = time.perf_counter()
    for path in files:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
        side = min(rgb.size)
        left, top = (rgb.width - side) // 2, (rgb.height - side) // 2
        square = rgb.crop((left, top, left + side, top + side))
        np.asarray(square.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC))
    return time.perf_counter() - started


def step_seconds(source: Path, out: Path, workers: int, validate: bool) -> float:
    """Seconds of the data step over `source` into a fresh folder under `out`."""
    if out.exists():
        shutil.rmtree(out)
    cfg = PrepareConfig(output_url=str(out), workers=workers,
                        images={"kind": "imagefolder", "path": str(source), "image_size": IMAGE_SIZE,
                                "min_class_ratio": 0, "near_dup_max_distance": 2})  # fmt: skip
    started = time.perf_counter()
    prepare_images(cfg, StorageConfig(), validate=validate)
    return time.perf_counter() - started


def measure_prepare(n_images: int = 2000, repeats: int = 3) -> dict[str, Any]:
    """images/s of bare Pillow and of the data step (1 and 2 workers, validation off; 1 worker with it on), and
    the median ratio step / bare at one worker."""
    work = Path(tempfile.mkdtemp(prefix="tdeploy-bench-vision-data-"))
    try:
        files = write_source(work / "src", n_images)
        step_seconds(work / "src", work / "warm", 1, validate=False)  # imports, page cache
        rounds = []
        for _ in range(repeats):
            bare = bare_pillow(files)
            one = step_seconds(work / "src", work / "out", 1, validate=False)
            two = step_seconds(work / "src", work / "out", 2, validate=False)
            rounds.append({"bare_s": bare, "step_1_s": one, "step_2_s": two, "ratio": bare / one})
        validated = step_seconds(work / "src", work / "out", 1, validate=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = median(r["ratio"] for r in rounds)
    return {
        "n_images": n_images,
        "source_px": list(SOURCE_PX),
        "image_size_px": IMAGE_SIZE,
        "bare_pillow_images_per_s": n_images / median(r["bare_s"] for r in rounds),
        "step_1_worker_images_per_s": n_images / median(r["step_1_s"] for r in rounds),
        "step_2_workers_images_per_s": n_images / median(r["step_2_s"] for r in rounds),
        "step_validated_images_per_s": n_images / validated,
        "ratio_step_over_bare": best,
        "goal_ratio": 0.8,
        "rounds": rounds,
    }


def main() -> None:
    """Command line: print the figures side by side and as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    result = measure_prepare(args.images, args.repeats)
    print(f"{'bare Pillow (1 thread)':<34}{result['bare_pillow_images_per_s']:>10.0f} images/s")
    print(f"{'data step, 1 worker':<34}{result['step_1_worker_images_per_s']:>10.0f} images/s")
    print(f"{'data step, 2 workers':<34}{result['step_2_workers_images_per_s']:>10.0f} images/s")
    print(f"{'data step, 1 worker, validated':<34}{result['step_validated_images_per_s']:>10.0f} images/s")
    verdict = "ok" if result["ratio_step_over_bare"] >= result["goal_ratio"] else "BELOW GOAL"
    print(f"ratio step / bare (1 worker, median): {result['ratio_step_over_bare']:.2f} (goal >= 0.8: {verdict})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
