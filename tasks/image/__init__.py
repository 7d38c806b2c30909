"""Training image build: a Containerfile rendered from the spec, a content-addressed tag, build, push, image.json.

Logic only (no Prefect): `ensure_image` is the step; `task.py` wraps it as the Prefect task `build_image`.
"""

from tasks.image.build import ImageResult, ensure_image, prepare_inputs
from tasks.image.config import ImageConfig

__all__ = ["ImageConfig", "ImageResult", "ensure_image", "prepare_inputs"]
