"""Fixtures for the image build: a private buildah store with a small Python base image, and a real registry.

No public registry is reachable, so the base image is made here: `buildah from
scratch`, Debian's static busybox for /bin/sh and the tools, and this machine's
own Python 3.11 (binary, standard library, the shared libraries they link) plus
pip copied in. That gives a base on which the rendered Containerfile's `pip
install` steps really run, and in which `import training` can be tried.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pip
import pytest

from tasks.image.build import ImageResult, ensure_image
from tasks.image.config import ImageConfig
from tasks.image.payload import payload_source
from tests.processes import start_group, stop_group
from training.network import listen_port

BASE_IMAGE = "localhost/tdeploy-test/python-base:3.11"
PYTHON = Path("/usr/bin/python3.11")
STDLIB = Path("/usr/lib/python3.11")
BUSYBOX = Path("/usr/bin/busybox")
UNUSED_STDLIB = shutil.ignore_patterns(
    "config-3.*",
    "test",
    "idlelib",
    "lib2to3",
    "pydoc_data",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "sqlite3",
    "curses",
    "dbm",
    "_sqlite3.*",
    "_dbm.*",
    "_gdbm.*",
    "_curses*",
    "readline.*",
    "_tkinter.*",
    "nis.*",
    "_test*",
    "_ctypes_test.*",
    "xxlimited*",
    "_xx*",
    "audioop.*",
    "ossaudiodev.*",
    "_crypt.*",
)


def buildah(store: Path, *args: str, timeout_s: float = 300) -> str:
    """Run buildah against the private vfs store `store` (the layout ImageConfig.storage_dir uses)."""
    cmd = ["buildah", "--storage-driver", "vfs", "--root", str(store / "storage"), "--runroot", str(store / "run")]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"buildah {' '.join(args)} failed:\n{proc.stderr[-3000:]}"
    return proc.stdout


def _shared_libraries(binaries: list[Path]) -> set[Path]:
    """Every shared library `binaries` load, from ldd."""
    libraries: set[Path] = set()
    for binary in binaries:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
                libraries.add(Path(parts[2]))
            elif parts and parts[0].startswith("/"):
                libraries.add(Path(parts[0]))
    return libraries


def make_python_base(store: Path, name: str = BASE_IMAGE) -> str:
    """Commit a busybox + Python 3.11 + pip image as `name` into `store`; returns its image ID.

    Files keep their mtimes and the commit uses --timestamp 0, so two stores get the same image ID.
    """
    for tool in ("buildah", "ldd"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed; run `bash .ci/setup --test` (installs .ci/apt/test/image.txt)")
    if not (BUSYBOX.exists() and PYTHON.exists()):
        pytest.fail(f"{BUSYBOX} and {PYTHON} are needed (Debian busybox-static, python3.11)")
    container = buildah(store, "from", "scratch").strip()
    root = Path(buildah(store, "mount", container).strip())
    (root / "bin").mkdir()
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True).stdout.split():
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    (root / "usr" / "bin").mkdir(parents=True)
    shutil.copy2(PYTHON, root / "usr" / "bin" / PYTHON.name)
    (root / "usr" / "bin" / "python3").symlink_to(PYTHON.name)
    # Every layer of a vfs store is a full copy of the tree, so leave out what pip and the payload never load.
    shutil.copytree(STDLIB, root / STDLIB.relative_to("/"), symlinks=True, ignore=UNUSED_STDLIB)
    site = root / "usr" / "lib" / "python3" / "dist-packages"
    shutil.copytree(
        Path(pip.__file__).parent, site / "pip", symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
    )
    binaries = [PYTHON, *sorted((root / STDLIB.relative_to("/") / "lib-dynload").glob("*.so"))]
    for library in sorted(_shared_libraries(binaries)):
        target = root / library.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(library.resolve(), target)
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    (root / "tmp").mkdir()
    (root / "tmp").chmod(0o1777)
    buildah(store, "config", "--env", "PATH=/usr/local/bin:/usr/bin:/bin", container)
    image_id = buildah(store, "commit", "--quiet", "--timestamp", "0", container, name).strip()
    buildah(store, "rm", container)
    return image_id


ENV = {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "^lo,docker", "TDEPLOY_NOTE": 'literal "$HOME" \\ kept'}


def image_config(store: Path, **overrides: Any) -> ImageConfig:
    """The test image: the local Python base, buildah on a private store, no pulls, no index downloads."""
    values: dict[str, Any] = {
        "base_image": BASE_IMAGE,
        "builder": "buildah",
        "pull_policy": "never",
        "install_payload_dependencies": False,
        "env": ENV,
        "storage_dir": str(store),
        "repository": "tdeploy-test/train",
    }
    return ImageConfig(**(values | overrides))


def make_busybox_base(store: Path, name: str) -> None:
    """Commit a busybox-only image (a shell, no Python) as `name` into `store`."""
    container = buildah(store, "from", "scratch").strip()
    root = Path(buildah(store, "mount", container).strip())
    (root / "bin").mkdir()
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in ("sh", "grep", "mkdir", "chown", "echo"):
        (root / "bin" / applet).symlink_to("busybox")
    buildah(store, "config", "--env", "PATH=/bin", container)
    buildah(store, "commit", "--quiet", "--timestamp", "0", container, name)
    buildah(store, "rm", container)


@pytest.fixture(scope="session")
def image_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private buildah store (vfs) holding the test base image."""
    store = tmp_path_factory.mktemp("buildah-store")
    make_python_base(store)
    return store


@pytest.fixture(scope="session")
def payload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A snapshot of training/, so that edits in a shared checkout during the session do not move the tag."""
    snapshot = tmp_path_factory.mktemp("payload") / "training"
    shutil.copytree(payload_source(), snapshot, ignore=shutil.ignore_patterns("__pycache__"))
    return snapshot


@pytest.fixture(scope="session")
def built(image_store: Path, payload: Path, tmp_path_factory: pytest.TempPathFactory) -> ImageResult:
    """One cold build of the test image (from the payload snapshot) into the session store."""
    record = tmp_path_factory.mktemp("record")
    return ensure_image(image_config(image_store), record, spec_digest="spec-digest", source=payload)


REGISTRY_USER, REGISTRY_PASSWORD = "tdeploy", "registry-test-password"


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real registry (Debian's docker-registry) on 127.0.0.1, plain HTTP; yields `127.0.0.1:PORT`."""
    yield from serve_registry(tmp_path_factory.mktemp("registry"))


@pytest.fixture(scope="session")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real registry that needs a login (htpasswd: REGISTRY_USER, REGISTRY_PASSWORD), plain HTTP."""
    folder = tmp_path_factory.mktemp("auth-registry")
    with warnings.catch_warnings():  # crypt is deprecated, but the only bcrypt here (no htpasswd, no bcrypt module)
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

        hashed = crypt.crypt(REGISTRY_PASSWORD, crypt.mksalt(crypt.METHOD_BLOWFISH))
    (folder / "htpasswd").write_text(f"{REGISTRY_USER}:{hashed}\n")
    auth = f"auth:\n  htpasswd:\n    realm: tdeploy-test\n    path: {folder / 'htpasswd'}\n"
    yield from serve_registry(folder, auth, expect_status=401)


def serve_registry(folder: Path, extra_config: str = "", expect_status: int = 200) -> Iterator[str]:
    """Run docker-registry from `folder` (config `extra_config` added) until the generator is closed."""
    exe = shutil.which("docker-registry")
    if exe is None:
        pytest.fail("docker-registry is not installed; run `bash .ci/setup --test` (installs .ci/apt/test/image.txt)")
    port = listen_port()
    config = folder / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {folder / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n" + extra_config
    )
    log = (folder / "registry.log").open("w")
    proc = start_group([exe, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (folder / "registry.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2) as response:
                    status, headers = response.status, response.headers
            except urllib.error.HTTPError as err:
                status, headers = err.code, err.headers
            except OSError:
                status, headers = 0, None
            if status == expect_status and headers and headers.get("Docker-Distribution-Api-Version") == "registry/2.0":
                break
            assert time.monotonic() < deadline, "the registry did not answer on /v2/ within 30 s"
            time.sleep(0.2)
        assert proc.poll() is None, "another server answered on the registry's port"
        yield f"127.0.0.1:{port}"
        assert proc.poll() is None, f"the registry stopped during the tests: {(folder / 'registry.log').read_text()}"
    finally:  # also when the wait above times out or fails
        stop_group(proc)
        log.close()


@pytest.fixture
def no_builder_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment without any image builder: PATH holds only python, and no Docker engine is reachable."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-docker.sock'}")
