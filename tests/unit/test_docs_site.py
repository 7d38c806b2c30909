"""The documentation site (docs/mkdocs.yml) builds with `mkdocs build --strict`: a broken link, a page left out
of the navigation or a spec field without a description fails the build, and so the suite."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

DOCS = REPO / "docs"


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of `config` into `site`, with the environment's own mkdocs."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir", str(site)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO, check=False)


def copy_docs(tmp_path: Path) -> Path:
    """The docs folder (config, pages, hooks) copied, so a test can break a page without touching the tree."""
    target = tmp_path / "docs"
    shutil.copytree(DOCS, target, ignore=shutil.ignore_patterns("build", "__pycache__"))
    return target


def test_the_site_builds_strictly_with_the_generated_spec_reference(tmp_path: Path) -> None:
    proc = build(DOCS / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reference = (tmp_path / "site" / "reference" / "spec" / "index.html").read_text()
    assert "cluster.slurm.mem_per_node_mb" in reference and "megabytes" in reference
    assert (tmp_path / "site" / "concepts" / "acceptance" / "index.html").exists()


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    docs = copy_docs(tmp_path)
    page = docs / "pages" / "getting-started.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    proc = build(docs / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0
    assert "no-such-page.md" in proc.stdout + proc.stderr


def test_a_spec_field_without_a_description_fails_the_build(tmp_path: Path) -> None:
    # A field added to a real sub-model of the spec in the building process, as a new field without
    # Field(description=...) would be: the hook refuses to render the reference and the build stops.
    script = (
        "import sys\n"
        "from pydantic.fields import FieldInfo\n"
        "from tasks.launch.cluster import ClusterConfig\n"
        "ClusterConfig.model_fields['undescribed_timeout_s'] = FieldInfo(annotation=int, default=1)\n"
        "from mkdocs.__main__ import cli\n"
        "sys.exit(cli())\n"
    )
    config, site = DOCS / "mkdocs.yml", tmp_path / "site"
    command = [sys.executable, "-c", script, "build", "--strict", "-f", str(config), "--site-dir", str(site)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO, check=False)
    assert proc.returncode != 0
    assert "cluster.undescribed_timeout_s" in proc.stdout + proc.stderr


def test_the_readme_links_only_to_pages_that_exist() -> None:
    readme = (REPO / "README.md").read_text()
    targets = [t.split("#", 1)[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t]
    assert any(t.startswith("docs/pages/") for t in targets), "the README links to the site's pages"
    missing = [t for t in targets if t and not (REPO / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
