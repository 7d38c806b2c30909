"""Write the synthetic ImageFolder of the ViT example: four classes of 32x32 PNG patterns, deterministic from a seed.

Classes: horizontal stripes, vertical stripes, checkerboard, diagonal stripes; each image draws its two colours,
stripe period, phase and sparse pixel noise from the seed, so no two images are alike (the data step's duplicate
and near-duplicate checks pass) while a tiny ViT still tells the classes apart within about a hundred steps.

    python examples/images/make_patterns.py            # writes examples/images/patterns/<class>/<n>.png
    python examples/images/make_patterns.py --out DIR --per-class 100 --seed 0
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("horizontal", "vertical", "checkerboard", "diagonal")
SIZE_PX = 32


def pattern(kind: str, rng: np.random.Generator, size: int = SIZE_PX, light: np.ndarray | None = None) -> np.ndarray:
    """One (size, size, 3) uint8 image of `kind`: two colours (`light` or a random light one, a random dark one),
    random period and phase, sparse noise."""
    period = int(rng.integers(4, 11))
    phase = int(rng.integers(0, period))
    y, x = np.mgrid[0:size, 0:size]
    half = period / 2
    if kind == "horizontal":
        mask = ((y + phase) % period) < half
    elif kind == "vertical":
        mask = ((x + phase) % period) < half
    elif kind == "checkerboard":
        mask = (((x + phase) // max(1, period // 2)) + ((y + phase) // max(1, period // 2))) % 2 == 0
    else:  # diagonal, either direction
        direction = x + y if rng.integers(0, 2) else x - y + size
        mask = ((direction + phase) % period) < half
    light = rng.integers(128, 256, 3) if light is None else np.asarray(light)
    dark = rng.integers(0, 128, 3)
    image = np.where(mask[..., None], light, dark)
    noisy = rng.random((size, size)) < 0.08
    image[noisy] = rng.integers(0, 256, (int(noisy.sum()), 3))
    return image.astype(np.uint8)


def write_patterns(out: Path, per_class: int = 100, seed: int = 0) -> list[Path]:
    """Write `per_class` PNGs per class under out/<class>/; returns the files written."""
    rng = np.random.default_rng(seed)
    files = []
    for kind in CLASSES:
        folder = out / kind
        folder.mkdir(parents=True, exist_ok=True)
        for number in range(per_class):
            path = folder / f"{number:03d}.png"
            Image.fromarray(pattern(kind, rng)).save(path, optimize=True)
            files.append(path)
    return files


def main() -> None:
    """Command line: write the example ImageFolder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "patterns")
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    files = write_patterns(args.out, args.per_class, args.seed)
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {len(files)} images ({total / 1e3:.0f} kB) under {args.out}")


if __name__ == "__main__":
    main()
