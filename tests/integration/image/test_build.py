"""The image step with a real builder (buildah: vfs store, chroot isolation, --pull=never) and a real registry."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tasks.image.build import ImageResult, ensure_image
from tasks.image.errors import BaseImageMissing, BuilderNotFound, BuildFailed, RegistryRejected
from tasks.image.registry import MANIFEST_TYPES
from tests.integration.image.conftest import (
    ENV,
    REGISTRY_PASSWORD,
    REGISTRY_USER,
    buildah,
    image_config,
    make_busybox_base,
    make_python_base,
)

pytestmark = pytest.mark.integration


def run_in_image(store: Path, reference: str, *argv: str) -> str:
    """`buildah run` a command in a fresh container of `reference` (as the image's user); returns stdout."""
    container = buildah(store, "from", "--pull=never", reference).strip()
    try:
        return buildah(store, "run", "--isolation", "chroot", container, "--", *argv)
    finally:
        buildah(store, "rm", container)


def layer_digests(store: Path, reference: str) -> list[str]:
    """The image's layer digests, base first."""
    data = json.loads(buildah(store, "inspect", "--type", "image", reference))
    return [layer["digest"] for layer in json.loads(data["Manifest"])["layers"]]


def registry_digest(registry: str, repository: str, tag: str) -> str:
    """The manifest digest the registry reports for a tag (HEAD, read independently of the code under test)."""
    request = urllib.request.Request(
        f"http://{registry}/v2/{repository}/manifests/{tag}", method="HEAD", headers={"Accept": MANIFEST_TYPES[0]}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.headers["Docker-Content-Digest"]


def test_build_from_rendered_containerfile_installs_payload_that_imports_inside_the_image(
    built: ImageResult, image_store: Path
) -> None:
    assert built.status == "built", built.reason
    assert built.reference == f"localhost/tdeploy-test/train:{built.tag}"
    record = json.loads((Path(built.record_dir) / "image.json").read_text())
    assert (record["tag"], record["image_id"]) == (built.tag, built.image_id)
    assert record["builder"].startswith("buildah")
    assert record["size_bytes"] > 10_000_000 and record["build_time_s"] > 0 and record["spec_digest"] == "spec-digest"
    context = Path(built.record_dir) / "context"
    assert (context / "Containerfile").read_text().startswith("# Rendered by transformer-deploy")
    assert (context / "payload" / built.payload_wheel).exists()

    probe = (
        "import importlib.metadata as m, os, training; "
        "print(training.__file__); print(m.version('tdeploy-training')); print(os.getuid()); "
        "print(os.environ['NCCL_SOCKET_IFNAME']); print(os.environ['TDEPLOY_NOTE'])"
    )
    lines = run_in_image(image_store, built.reference, "python3", "-c", probe).splitlines()
    assert lines[0].endswith("/dist-packages/training/__init__.py")
    assert lines[1] == built.labels["org.opencontainers.image.version"]
    assert lines[2] == "1000", "the job must run as the non-root user"
    assert lines[3:] == [ENV["NCCL_SOCKET_IFNAME"], ENV["TDEPLOY_NOTE"]]

    config = json.loads(buildah(image_store, "inspect", "--type", "image", built.reference))["OCIv1"]["config"]
    assert config["Entrypoint"] == ["torchrun"]
    assert config["Cmd"][-4:] == ["-m", "training.train", "--config", "/workspace/run.json"]
    assert config["User"] == "1000:1000"
    labels = config["Labels"]
    assert labels["io.transformer-deploy.payload-sha256"] == built.payload_sha256
    assert labels["org.opencontainers.image.revision"] == built.labels["org.opencontainers.image.revision"]
    assert "io.transformer-deploy.image-spec-sha256" in labels


def test_same_inputs_give_same_tag_and_image_id_and_the_second_run_is_a_cache_hit(
    built: ImageResult, image_store: Path, payload: Path, tmp_path: Path
) -> None:
    again = ensure_image(image_config(image_store), tmp_path / "again", source=payload)
    assert again.status == "cached" and "already in buildah's local store" in again.reason
    assert (again.tag, again.image_id) == (built.tag, built.image_id)
    assert again.steps is None, "a cache hit runs no build"

    # A fresh store, its own copy of the base, no layer cache: the build is reproduced bit for bit.
    fresh = tmp_path / "fresh-store"
    make_python_base(fresh)
    rebuilt = ensure_image(image_config(fresh), tmp_path / "fresh-record", source=payload)
    assert rebuilt.status == "built" and rebuilt.cached_steps == 0
    assert (rebuilt.tag, rebuilt.image_id) == (built.tag, built.image_id)


def test_changed_payload_gets_new_tag_and_rebuilds_only_the_payload_layers(
    built: ImageResult, image_store: Path, payload: Path, tmp_path: Path
) -> None:
    source = tmp_path / "training"
    shutil.copytree(payload, source)
    with (source / "__init__.py").open("a") as handle:
        handle.write("PAYLOAD_EDIT = 1\n")
    changed = ensure_image(image_config(image_store), tmp_path / "record", source=source)
    assert changed.status == "built" and changed.tag != built.tag and changed.image_id != built.image_id
    assert changed.payload_sha256 != built.payload_sha256

    before, after = layer_digests(image_store, built.reference), layer_digests(image_store, changed.reference)
    assert len(before) == len(after)
    # base and user layers (and ENV, WORKDIR, ENTRYPOINT, CMD) come from the cache; only the payload layers are new
    assert before[:-2] == after[:-2] and all(b != a for b, a in zip(before[-2:], after[-2:], strict=True))
    assert changed.cached_steps == 5, (Path(changed.record_dir) / "build.log").read_text()[-3000:]
    probe = "import training; print(training.PAYLOAD_EDIT)"
    assert run_in_image(image_store, changed.reference, "python3", "-c", probe).strip() == "1"


def test_push_records_the_digest_the_registry_reports_and_a_rerun_skips(
    built: ImageResult, image_store: Path, payload: Path, registry: str, tmp_path: Path
) -> None:
    cfg = image_config(image_store, registry_url=registry, registry_insecure=True)
    pushed = ensure_image(cfg, tmp_path / "push", source=payload)
    assert pushed.pushed and pushed.tag == built.tag, (pushed, built)
    assert pushed.reference == f"{registry}/tdeploy-test/train:{built.tag}"
    assert pushed.digest == registry_digest(registry, "tdeploy-test/train", built.tag), pushed
    assert pushed.image_id == built.image_id, (pushed, built)
    record = json.loads((tmp_path / "push" / "image.json").read_text())
    assert record["digest"] == pushed.digest
    assert record["reference_by_digest"] == f"{registry}/tdeploy-test/train@{pushed.digest}"

    # What the job submission will use: the image pulls by that digest.
    buildah(image_store, "pull", "--quiet", "--tls-verify=false", record["reference_by_digest"])

    again = ensure_image(cfg, tmp_path / "again", source=payload)
    assert again.status == "cached" and f"already in registry {registry}" in again.reason, again
    assert (again.digest, again.image_id) == (pushed.digest, pushed.image_id), (again, pushed)


def test_a_registry_that_needs_a_login_uses_the_users_buildah_login(
    built: ImageResult,
    image_store: Path,
    payload: Path,
    auth_registry: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("TDEPLOY_REGISTRY_USERNAME", "TDEPLOY_REGISTRY_PASSWORD", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.docker/config.json nor containers auth.json
    cfg = image_config(image_store, registry_url=auth_registry, registry_insecure=True)
    authfile = tmp_path / "auth.json"
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(authfile))
    login = subprocess.run(
        ["buildah", "login", "--tls-verify=false", "-u", REGISTRY_USER, "--password-stdin", auth_registry],
        input=REGISTRY_PASSWORD, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert login.returncode == 0, login.stderr
    assert auth_registry in json.loads(authfile.read_text())["auths"], "buildah login wrote no auth.json entry"

    pushed = ensure_image(cfg, tmp_path / "push", source=payload)
    assert pushed.pushed and pushed.tag == built.tag and pushed.digest, pushed
    again = ensure_image(cfg, tmp_path / "again", source=payload)
    assert again.status == "cached" and f"already in registry {auth_registry}" in again.reason, again
    assert again.digest == pushed.digest, (again, pushed)

    wrong = base64.b64encode(f"{REGISTRY_USER}:not-the-password".encode()).decode()
    authfile.write_text(json.dumps({"auths": {auth_registry: {"auth": wrong}}}))
    with pytest.raises(RegistryRejected, match="authentication required.*buildah login"):
        ensure_image(cfg, tmp_path / "wrong", source=payload)
    # TDEPLOY_REGISTRY_* take precedence over the user's login
    monkeypatch.setenv("TDEPLOY_REGISTRY_USERNAME", REGISTRY_USER)
    monkeypatch.setenv("TDEPLOY_REGISTRY_PASSWORD", REGISTRY_PASSWORD)
    assert ensure_image(cfg, tmp_path / "from-env", source=payload).digest == pushed.digest


def test_plain_http_registry_without_registry_insecure_is_refused_with_the_fix(
    image_store: Path, payload: Path, registry: str, tmp_path: Path
) -> None:
    with pytest.raises(RegistryRejected, match="TLS failed.*set image.registry_insecure: true"):
        ensure_image(image_config(image_store, registry_url=registry), tmp_path, source=payload)


def test_missing_base_image_is_a_clear_error_and_a_local_run_skips_with_the_reason(
    image_store: Path, tmp_path: Path
) -> None:
    cfg = image_config(image_store, base_image="localhost/tdeploy-test/not-there:1")
    with pytest.raises(BaseImageMissing) as caught:
        ensure_image(cfg, tmp_path / "record")
    message = str(caught.value)
    assert "image.base_image=localhost/tdeploy-test/not-there:1" in message
    assert "pull_policy=never forbids pulling it" in message and "buildah pull oci-archive:FILE" in message

    skipped = ensure_image(cfg, tmp_path / "local", allow_skip=True)
    assert skipped.status == "skipped" and "not-there:1" in skipped.reason
    assert "the local run uses the current environment" in skipped.reason
    assert json.loads((tmp_path / "local" / "image.json").read_text())["status"] == "skipped"


def test_base_image_without_python_fails_the_build_with_the_builders_own_words(
    image_store: Path, payload: Path, tmp_path: Path
) -> None:
    make_busybox_base(image_store, "localhost/tdeploy-test/busybox:1")
    with pytest.raises(BuildFailed) as caught:
        ensure_image(image_config(image_store, base_image="localhost/tdeploy-test/busybox:1"), tmp_path, source=payload)
    message = str(caught.value)
    assert "buildah could not build the image from" in message and "python3: not found" in message
    assert "the base image needs python3 with pip" in message
    assert "python3: not found" in (tmp_path / "build.log").read_text()


@pytest.mark.usefixtures("no_builder_path")
def test_missing_builder_is_a_clear_error_naming_each_candidate_and_how_to_install_one(
    image_store: Path, tmp_path: Path
) -> None:
    with pytest.raises(BuilderNotFound) as caught:
        ensure_image(image_config(image_store, builder="auto"), tmp_path / "record")
    message = str(caught.value)
    assert "docker: no engine answers at unix://" in message
    assert "podman: not on PATH" in message and "buildah: not on PATH" in message
    assert "apt-get install buildah" in message

    with pytest.raises(BuilderNotFound, match=r"image.builder=podman: .*podman: not on PATH"):
        ensure_image(image_config(image_store, builder="podman"), tmp_path / "record")

    skipped = ensure_image(image_config(image_store, builder="auto"), tmp_path / "local", allow_skip=True)
    assert skipped.status == "skipped" and "no usable image builder" in skipped.reason
