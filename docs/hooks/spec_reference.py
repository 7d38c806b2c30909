"""MkDocs hook: the spec reference page (reference/spec.md), generated from the pydantic models at build time.

A spec field without a description fails the build (tasks.spec_reference.UndescribedFields).
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

from tasks.spec_reference import UndescribedFields, spec_reference

PAGE = "reference/spec.md"
REPO = Path(__file__).resolve().parents[2]


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated reference page to the site's files."""
    try:
        content = spec_reference(REPO / "examples")
    except UndescribedFields as err:
        raise PluginError(str(err)) from err
    files.append(File.generated(config, PAGE, content=content))
    return files
