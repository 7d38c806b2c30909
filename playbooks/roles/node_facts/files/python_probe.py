"""Report the job's Python and its torch build as JSON, without importing torch (seconds on big nodes).

Runs under the Python the training job uses on the node, which may be old: Python 3.8 syntax and stdlib only.
"""

import ast
import importlib.util
import json
import os
import platform
import sys
from importlib import metadata


def distribution_version(name):
    """Installed version of a distribution, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def torch_build():
    """torch's version and its CUDA/HIP build, read from torch/version.py."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return {"version": None, "cuda": None, "hip": None, "path": None}
    folder = list(spec.submodule_search_locations)[0]
    values = {}
    try:
        with open(os.path.join(folder, "version.py"), encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError):
        tree = ast.parse("")
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        value = getattr(node, "value", None)
        for target in targets:
            if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
                values[target.id] = value.value
    return {
        "version": values.get("__version__") or distribution_version("torch"),
        "cuda": values.get("cuda"),
        "hip": values.get("hip"),
        "path": folder,
    }


def nccl_wheel():
    """Version of the NCCL wheel torch loads (nvidia-nccl-cuXX), or None."""
    for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11", "nvidia-nccl"):
        version = distribution_version(name)
        if version:
            return version
    return None


print(
    json.dumps(
        {
            "executable": sys.executable,
            "version": platform.python_version(),
            "torch": torch_build(),
            "nccl_wheel": nccl_wheel(),
        }
    )
)
