"""Write the captioned images of the vision-language example: a Hugging Face dataset saved to disk.

Each row is a 32x32 PNG of the patterns in make_patterns.py drawn in a named colour, with its caption
("red horizontal stripes", "blue checkerboard"). The data step reads it with
`data.prepare.images: {kind: hf, path: examples/images/captions, caption_column: caption}`.

    python examples/images/make_captions.py            # writes examples/images/captions/
    python examples/images/make_captions.py --out DIR --images 240 --seed 0
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_patterns import CLASSES, pattern  # noqa: E402 - the example folder is no package

COLOURS = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 240),
    "yellow": (240, 220, 40),
    "white": (245, 245, 245),
    "orange": (250, 150, 30),
}
NOUNS = {"horizontal": "horizontal stripes", "vertical": "vertical stripes", "checkerboard": "checkerboard",
         "diagonal": "diagonal stripes"}  # fmt: skip


def captioned(n_images: int, seed: int = 0) -> list[tuple[bytes, str]]:
    """(PNG bytes, caption) of `n_images` images cycling through every colour and pattern."""
    rng = np.random.default_rng(seed)
    rows = []
    combos = [(colour, kind) for colour in COLOURS for kind in CLASSES]
    for number in range(n_images):
        colour, kind = combos[number % len(combos)]
        image = pattern(kind, rng, light=np.array(COLOURS[colour]))
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG", optimize=True)
        rows.append((buffer.getvalue(), f"{colour} {NOUNS[kind]}"))
    return rows


def write_captions(out: Path, n_images: int = 240, seed: int = 0) -> Path:
    """Save the captioned images as a Hugging Face dataset (columns image, caption) at `out`."""
    import datasets

    rows = captioned(n_images, seed)
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string")})
    table = {"image": [{"bytes": png, "path": None} for png, _ in rows], "caption": [c for _, c in rows]}
    if out.exists():
        shutil.rmtree(out)
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(out))
    return out


def main() -> None:
    """Command line: write the example captioned dataset."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "captions")
    parser.add_argument("--images", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = write_captions(args.out, args.images, args.seed)
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {args.images} captioned images ({total / 1e3:.0f} kB) to {out}")


if __name__ == "__main__":
    main()
