"""The image section of the spec, the payload wheel and the rendered Containerfile (no builder needed)."""

from __future__ import annotations

import ast
import email.parser
import importlib.metadata
import re
import shlex
import subprocess
import sys
import zipfile
from io import BytesIO
from pathlib import Path

import pytest

from tasks.errors import UserError
from tasks.image.build import image_requirements, prepare_inputs
from tasks.image.config import ImageConfig
from tasks.image.payload import (
    OPTIONAL_DEPENDENCIES,
    RUNTIME_DEPENDENCIES,
    build_wheel,
    payload_source,
    pinned_dependencies,
    source_revision,
)
from tasks.spec import SpecError, load_spec, parse_spec
from tests.conftest import REPO, TINY_SPEC, deep_merge

BASE = deep_merge(
    TINY_SPEC,
    {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}},
)

BAD_IMAGES = [
    ({"builder": "kaniko"}, "image.builder=kaniko: must be one of 'auto', 'docker', 'podman' or 'buildah'"),
    ({"pull_policy": "always"}, "image.pull_policy=always: must be one of 'missing' or 'never'"),
    ({"registry_url": "https://reg.example.com"}, "image.registry_url=https://reg.example.com: must match"),
    ({"repository": "Team/Train"}, "image.repository=Team/Train: must match the pattern"),
    ({"uid": 0}, "image.uid=0: must be >= 1"),
    ({"user": "Root User"}, "image.user=Root User: must match the pattern"),
    ({"extra_requirements": ["numpy>=1.26"]}, "image.extra_requirements=[\"numpy>=1.26\"]: 'numpy>=1.26' must be"),
    ({"extra_requirements": ["numpy==2.*"]}, "image.extra_requirements=[\"numpy==2.*\"]: 'numpy==2.*' must be"),
    ({"env": {"HF_TOKEN": "x"}}, "image.env={...}: 'HF_TOKEN' looks like a credential; secrets never sit in specs"),
    ({"env": {"NCCL-DEBUG": "x"}}, "image.env={...}: 'NCCL-DEBUG' is not a valid variable name"),
    ({"env": {"PATH": "/x"}}, "image.env={...}: 'PATH' is set by the image itself; remove it"),
    ({"base_image": "pytorch/pytorch: 2"}, "image.base_image=pytorch/pytorch: 2: 'pytorch/pytorch: 2' is not an image"),
    ({"base_image": "alpine\nRUN id"}, "image.base_image="),
    (
        {"base_image": "alpine AS build"},
        "image.base_image=alpine AS build: 'alpine AS build' is not an image reference",
    ),
    ({"env": {"A\n": "x"}}, "image.env={...}: 'A\\n' is not a valid variable name"),
    ({"env": {"NOTE": "a\rRUN id"}}, "image.env={...}: NOTE: the value must be one line without control characters"),
    ({"storage_dir": "/var/store\n"}, "image.storage_dir="),
    ({"build_timeout_s": float("inf")}, "image.build_timeout_s=Infinity: must be a finite number"),
    ({"build_timeout_s": 1e30}, "image.build_timeout_s=1e+30: must be <= 604800"),
    ({"build_timeout_s": 0}, "image.build_timeout_s=0: must be > 0"),
    ({"pull": "never"}, "image.pull=never: is not a known field; remove it"),
]


@pytest.mark.parametrize(
    ("image", "expected"), BAD_IMAGES, ids=[e.split("=")[0] + str(i) for i, (_, e) in enumerate(BAD_IMAGES)]
)
def test_bad_image_section_is_refused_with_field_value_and_fix(image: dict, expected: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(deep_merge(BASE, {"image": image}))
    assert any(p.startswith(expected) for p in caught.value.problems), caught.value.problems


def test_local_default_spec_has_image_defaults_and_null_turns_the_image_off() -> None:
    spec = load_spec(REPO / "examples" / "local.yaml")
    assert spec.image == ImageConfig()
    assert spec.image.builder == "auto" and spec.image.registry_url is None and spec.image.uid == 1000
    assert parse_spec({**BASE, "image": None}).image is None
    pinned = parse_spec(deep_merge(BASE, {"image": {"extra_requirements": ["nvidia-ml-py==12.560.30"]}}))
    assert pinned.image is not None and pinned.image.extra_requirements == ["nvidia-ml-py==12.560.30"]


def test_payload_wheel_is_byte_reproducible_and_holds_only_the_training_package(payload_copy: Path) -> None:
    first, second = build_wheel(payload_copy), build_wheel(payload_copy)
    assert first.data == second.data and first.sha256 == second.sha256
    names = zipfile.ZipFile(BytesIO(first.data)).namelist()
    packages = {name.split("/")[0] for name in names}
    assert packages == {"training", f"tdeploy_training-{first.version}.dist-info"}
    assert not [n for n in names if n.endswith(".pyc") or "__pycache__" in n]
    assert {p.relative_to(payload_copy).as_posix() for p in payload_copy.rglob("*.py")} == {
        n.removeprefix("training/") for n in names if n.startswith("training/")
    }
    metadata = email.parser.Parser().parsestr(
        zipfile.ZipFile(BytesIO(first.data)).read(f"tdeploy_training-{first.version}.dist-info/METADATA").decode()
    )
    requires = [re.split(r"[<>=!;\s]", r)[0] for r in metadata.get_all("Requires-Dist")]
    assert requires == ["torch", "numpy", "fsspec", "pydantic", "safetensors", "s3fs", "prometheus-client",
                        "nvidia-ml-py", "torchft", "torchao"]  # fmt: skip
    assert 'extra == "s3"' in metadata.get_all("Requires-Dist")[5]
    assert metadata.get_all("Provides-Extra") == ["s3", "telemetry", "live_recovery", "fp8"]

    (payload_copy / "model.py").write_text((payload_copy / "model.py").read_text() + "# one more line\n")
    assert build_wheel(payload_copy).sha256 != first.sha256


def test_payload_wheel_installs_with_pip_and_imports_without_the_orchestration_stack(tmp_path: Path) -> None:
    wheel = build_wheel().write(tmp_path / "dist")
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(target)]
    proc = subprocess.run([*pip, str(wheel)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    probe = (
        "import sys, importlib.metadata as m\n"
        "sys.modules.update({name: None for name in ('prefect', 'great_expectations', 'ansible_runner', 'tasks')})\n"
        "import training, training.train\n"
        "print(training.__file__); print(m.version('tdeploy-training'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r})\n{probe}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        str(target / "training" / "__init__.py"),
        importlib.metadata.version("transformer-deploy"),
    ]


# Import name -> distribution name, where they differ.
DISTRIBUTIONS = {"pydantic_core": "pydantic", "prometheus_client": "prometheus-client", "pynvml": "nvidia-ml-py"}


def test_payload_imports_nothing_beyond_its_declared_dependencies() -> None:
    optional = {name for names in OPTIONAL_DEPENDENCIES.values() for name in names}
    required_found: set[str] = set()
    optional_found: set[str] = set()
    for path in payload_source().rglob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module.split(".")[0]]
            names = [n for n in names if n not in sys.stdlib_module_names and n not in ("__future__", "training")]
            (required_found if id(node) in top_level else optional_found).update(DISTRIBUTIONS.get(n, n) for n in names)
    assert required_found <= set(RUNTIME_DEPENDENCIES), f"module-level imports {sorted(required_found)}: declare them"
    undeclared = optional_found - set(RUNTIME_DEPENDENCIES) - optional
    assert not undeclared, f"the payload imports {sorted(undeclared)}: add them to OPTIONAL_DEPENDENCIES"


def test_pinned_dependencies_match_this_environment_and_leave_torch_to_the_base_image() -> None:
    pins = pinned_dependencies(with_s3=False)
    names = {p.split("==")[0] for p in pins}
    assert {"numpy", "fsspec", "pydantic", "pydantic-core"} <= names and "torch" not in names and "s3fs" not in names
    assert all(p == f"{p.split('==')[0]}=={importlib.metadata.version(p.split('==')[0])}" for p in pins)
    assert {"s3fs", "botocore"} <= {p.split("==")[0] for p in pinned_dependencies(with_s3=True)}

    cfg = ImageConfig(extra_requirements=["numpy==1.26.4", "nvidia-ml-py==12.560.30"])
    merged = image_requirements(cfg, with_s3=False)
    assert "numpy==1.26.4" in merged and "nvidia-ml-py==12.560.30" in merged, "the spec's pins win"
    assert image_requirements(ImageConfig(install_payload_dependencies=False), with_s3=True) == []


def test_containerfile_pins_everything_and_tag_follows_content_only(payload_copy: Path) -> None:
    cfg = ImageConfig(base_image="nvcr.io/nvidia/pytorch:25.01-py3", env={"NCCL_DEBUG": "WARN", "NOTE": 'a "$b" \\ c'})
    inputs = prepare_inputs(cfg, source=payload_copy)
    text = inputs.containerfile
    assert text.splitlines()[1] == "FROM nvcr.io/nvidia/pytorch:25.01-py3"
    assert 'NCCL_DEBUG="WARN"' in text and r'NOTE="a \"\$b\" \\ c"' in text
    assert f"--no-deps --no-index /opt/transformer-deploy/payload/{inputs.wheel.filename}\n" in text
    assert text.rstrip().endswith("USER 1000:1000") and 'ENTRYPOINT ["torchrun"]' in text
    assert 'org.opencontainers.image.base.name="nvcr.io/nvidia/pytorch:25.01-py3"' in text
    assert f'io.transformer-deploy.payload-sha256="{inputs.wheel.sha256}"' in text
    assert all("==" in r for r in inputs.requirements) and inputs.requirements
    assert re.fullmatch(r"\d+\.\d+\.\d+-[0-9a-f]{16}", inputs.tag)

    assert prepare_inputs(cfg, source=payload_copy).tag == inputs.tag
    elsewhere = cfg.model_copy(update={"registry_url": "reg.example.com:5000/ml", "builder": "podman"})
    assert prepare_inputs(elsewhere, source=payload_copy).tag == inputs.tag, "where it goes is not what it is"
    more_env = cfg.model_copy(update={"env": {**cfg.env, "NCCL_IB_DISABLE": "1"}})
    assert prepare_inputs(more_env, source=payload_copy).tag != inputs.tag
    (payload_copy / "sampler.py").write_text((payload_copy / "sampler.py").read_text() + "\n")
    assert prepare_inputs(cfg, source=payload_copy).tag != inputs.tag


def test_source_revision_names_the_last_commit_of_training_or_unknown(tmp_path: Path) -> None:
    revision = source_revision(payload_source())
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", revision), revision
    assert source_revision(tmp_path) == "unknown"


def test_pip_steps_are_quoted_word_by_word_and_no_spec_value_reaches_a_shell_unquoted(payload_copy: Path) -> None:
    inputs = prepare_inputs(ImageConfig(extra_requirements=["nvidia-ml-py==12.560.30"]), source=payload_copy)
    runs = [line.removeprefix("RUN ") for line in inputs.containerfile.splitlines() if line.startswith("RUN ")]
    pip = [shlex.split(run) for run in runs if "pip" in run]
    assert len(pip) == 2 and all(words[:1] == ["PYTHONDONTWRITEBYTECODE=1"] for words in pip)
    assert all(shlex.join(words) == run for words, run in zip(pip, [r for r in runs if "pip" in r], strict=True))
    assert pip[1][-1] == f"/opt/transformer-deploy/payload/{inputs.wheel.filename}"
    users = [run for run in runs if "pip" not in run]
    assert len(users) == 1 and "echo trainer:x:1000:1000::/home/trainer:/bin/sh >> /etc/passwd" in users[0]


def test_values_that_bypassed_the_spec_cannot_add_containerfile_instructions(payload_copy: Path) -> None:
    cfg = ImageConfig()
    for update in (
        {"env": {"NOTE": "x\nRUN touch /pwned"}},
        {"env": {"A=1\nRUN touch /pwned\nENV B": "1"}},
        {"base_image": "alpine\nRUN touch /pwned"},
        {"user": "x; touch /pwned"},
    ):
        with pytest.raises(UserError, match="cannot"):
            prepare_inputs(cfg.model_copy(update=update), source=payload_copy)
