"""fsspec access to local paths and object stores with the spec's storage settings."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import stat
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Annotated, Any

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from training.secrets import REDACTED, credential_message, find_credentials
from training.untrusted import escape_untrusted

# Schemes a storage URL may use: local files and the object stores fsspec reaches with the spec's options.
URL_SCHEMES = ("file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "hdfs", "memory")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def check_storage_url(value: str) -> str:
    """Refuse URLs with control characters (NUL, newline) or a scheme fsspec storage is not meant to use."""
    if not value.strip():
        raise ValueError("must not be empty or blank; give a local path or an s3:// URL")
    if value != value.strip():
        raise ValueError("starts or ends with white space (a folder named by spaces?); remove it")
    if _CONTROL.search(value):
        raise ValueError("contains a control character (NUL, newline, tab...); remove it")
    match = _SCHEME.match(value)
    if match is None and "://" in value:
        raise ValueError("is not a URL fsspec can open; use a local path or scheme://path")
    if match is not None and match.group(1).lower() not in URL_SCHEMES:
        raise ValueError(f"has the unknown scheme {match.group(1)!r}; use a local path or one of {list(URL_SCHEMES)}")
    _no_password(value)
    return value


def _no_password(value: str) -> None:
    authority = value.split("://", 1)[1].split("/", 1)[0] if "://" in value else ""
    if ":" in authority.rpartition("@")[0]:
        raise ValueError(
            "holds a password (user:password@); secrets never sit in specs: set it in the job's environment "
            "or a Prefect Secret block"
        )


_ENDPOINT = re.compile(
    r"https?://(?:[A-Za-z0-9][A-Za-z0-9.-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\])(?::[0-9]{1,5})?(?:/\S{0,2048})?"
)
"""An endpoint: scheme, host name, IPv4 or [IPv6] address, optional port and path (bounded: no backtracking)."""


def check_endpoint_url(value: str) -> str:
    """Refuse an endpoint that is not http(s)://host[:port][/path], or that holds control characters or a password."""
    if _CONTROL.search(value):
        raise ValueError("contains a control character (NUL, newline, tab...); remove it")
    _no_password(value)
    if not _ENDPOINT.fullmatch(value):
        raise ValueError("must be an http:// or https:// URL of a host name or address, e.g. http://127.0.0.1:9000")
    return value


StorageUrl = Annotated[str, AfterValidator(check_storage_url)]
"""A local path or an fsspec URL with a known scheme (the spec boundary's type for every storage location)."""


def check_local_path(value: str) -> str:
    """A storage URL that names a folder on this machine (a path or file://)."""
    check_storage_url(value)
    if not is_local(value):
        raise ValueError("must be a local folder (a path or file://...), not an object-store URL")
    return value


LocalPath = Annotated[str, AfterValidator(check_local_path)]
"""A path (or file:// URL) on the machine that runs the step, with the checks of StorageUrl."""


class StorageConfig(BaseModel):
    """Options for remote URLs. Credentials come from the environment (AWS_ACCESS_KEY_ID, ...), never the spec."""

    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)

    s3_endpoint_url: Annotated[str, AfterValidator(check_endpoint_url)] | None = Field(
        default=None, description="S3-compatible endpoint, e.g. http://127.0.0.1:9000; None = AWS."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Extra fsspec storage options for remote URLs (no credentials)."
    )

    @model_validator(mode="after")
    def _no_secrets(self) -> StorageConfig:
        found = find_credentials(self.options, ("options",))
        if found:
            raise ValidationError.from_exception_data(
                "StorageConfig",
                [
                    {"type": PydanticCustomError("spec", credential_message(variable)), "loc": loc, "input": REDACTED}
                    for loc, variable in found
                ],
            )
        return self

    def fsspec_options(self, url: str) -> dict[str, Any]:
        """Storage options for `url`'s protocol."""
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        if protocol == "file":
            return {}
        opts = dict(self.options)
        if protocol in ("s3", "s3a") and self.s3_endpoint_url:
            client_kwargs = dict(opts.get("client_kwargs", {}))
            client_kwargs.setdefault("endpoint_url", self.s3_endpoint_url)
            opts["client_kwargs"] = client_kwargs
        return opts


def is_local(url: str) -> bool:
    """True for plain paths and file:// URLs."""
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """The filesystem path of a local URL."""
    return url[len("file://") :] if url.startswith("file://") else url


def filesystem(url: str, storage: StorageConfig | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """An fsspec filesystem and the protocol-less path for `url`."""
    storage = storage or StorageConfig()
    # Each call gets a fresh instance: a cached s3fs instance keeps its event loop and
    # connections across fork()/torchrun restarts and across endpoint restarts.
    return url_to_fs(url, skip_instance_cache=True, **storage.fsspec_options(url))


def join(url: str, *parts: str) -> str:
    """Join URL path parts with '/' (works for paths and object-store URLs)."""
    out = url.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


_NO_SPACE_TEXTS = ("No space left on device", "Disk quota exceeded")  # libraries that wrap the OSError in text


def is_no_space(exc: BaseException) -> bool:
    """True when `exc`, or what it was raised from or during, is a full disk or quota (ENOSPC, EDQUOT), also where
    a library only kept the message (safetensors' SafetensorError, torch's short writes)."""
    err: BaseException | None = exc
    for _hop in range(16):  # the implicit context counts too: an error raised while handling ENOSPC hides it there
        if err is None:
            return False
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(err) for text in _NO_SPACE_TEXTS):
            return True
        err = err.__cause__ or err.__context__
    return False


def free_bytes(url: str) -> int | None:
    """Free bytes on the local disk that holds `url` (its nearest existing folder); None for object stores."""
    if not is_local(url):
        return None
    probe = os.path.abspath(local_path(url))
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe).free


def format_bytes(nbytes: float) -> str:
    """A size for a message: GB, MB or kB (decimal units, as `df -H` shows them)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1e3:.0f} kB"


def no_space_message(url: str, what: str, needed_bytes: int | None, free: int | None) -> str:
    """'no space left on <url>: <what> needs ~X, Y free', saying which of the sizes is unknown."""
    shown = "unknown" if free is None else format_bytes(free)
    if needed_bytes is None:
        return f"no space left on {url}: {what} needs more than the {shown} free there"
    return f"no space left on {url}: {what} needs ~{format_bytes(needed_bytes)}, {shown} free"


def sha256_file(fs: fsspec.AbstractFileSystem, path: str, chunk_bytes: int = 8 << 20) -> str:
    """Streaming sha256 of one file (hashlib releases the GIL, so threads hash several files at once)."""
    if isinstance(fs, LocalFileSystem):
        with open(path, "rb", buffering=0) as raw:  # readinto one reused buffer: no copy, no allocation per chunk
            return hashlib.file_digest(raw, "sha256").hexdigest()
    digest = hashlib.sha256()
    with fs.open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_files(fs: fsspec.AbstractFileSystem, paths: Iterable[str], threads: int = 4) -> dict[str, str]:
    """sha256 of each file in `paths`, hashed `threads` at a time; by path."""
    todo = list(dict.fromkeys(paths))
    if len(todo) <= 1 or threads <= 1:
        return {path: sha256_file(fs, path) for path in todo}
    with ThreadPoolExecutor(max_workers=min(threads, len(todo)), thread_name_prefix="sha256") as pool:
        return dict(zip(todo, pool.map(lambda path: sha256_file(fs, path), todo), strict=True))


class DigestingWriter:
    """A write-only stream that hashes (sha256) and counts the bytes it passes on to `inner`, so that a file's
    checksum is known once it is written, without reading it back."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self.nbytes = 0
        self._digest = hashlib.sha256()

    def write(self, data: Any) -> int:
        """Write `data` (any contiguous buffer) through, and hash it."""
        view = memoryview(data)
        written = self.inner.write(view)
        if written is not None and written != view.nbytes:  # buffered and fsspec files write all or raise
            raise OSError(errno.EIO, f"short write: {written} of {view.nbytes} bytes")
        self._digest.update(view)
        self.nbytes += view.nbytes
        return view.nbytes

    def hexdigest(self) -> str:
        """sha256 of everything written so far."""
        return self._digest.hexdigest()

    def tell(self) -> int:
        """The inner stream's position."""
        return self.inner.tell()

    def flush(self) -> None:
        """Flush the inner stream."""
        self.inner.flush()

    def fileno(self) -> int:
        """The inner file's descriptor, its buffer flushed first (callers fsync it)."""
        self.inner.flush()
        return self.inner.fileno()

    def writable(self) -> bool:
        """Always."""
        return True

    def close(self) -> None:
        """Close the inner stream."""
        self.inner.close()


CONTROL_FILE_MAX_BYTES = 4 << 20
"""Largest control file read (LEASE.json, COMMIT.json, a dataset's manifest.json, EXPORT.json, a run's small JSON
records): the biggest real one, a manifest of thousands of shards, is well under 1 MiB."""


class ControlFileError(ValueError):
    """A control file on storage that is no regular file (a link, a FIFO, a device) or is over its size limit."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(
            f"{path}: {problem}; the file is written as a small regular file, so something else put this there: "
            "remove it (and check who can write to this storage)"
        )
        self.path, self.problem = path, problem


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
             (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "special file")


_CONTROL_READ_CHUNK = 1 << 20


def read_control_file(fs: fsspec.AbstractFileSystem, path: str, limit: int = CONTROL_FILE_MAX_BYTES) -> bytes:
    """The bytes of a small control file, read without following a link at its name, from a regular file only,
    and at most `limit` bytes: ControlFileError (naming the file) otherwise, FileNotFoundError when it is absent.

    Local files are opened with O_NOFOLLOW | O_NONBLOCK (a FIFO does not block the open) and checked with fstat;
    object stores are asked for the size first, and the read is capped again in case it grew meanwhile."""
    if isinstance(fs, LocalFileSystem):
        return _read_local_control_file(local_path(path), limit)
    info = fs.info(path)
    if info.get("type") != "file":
        raise ControlFileError(path, f"is a {info.get('type') or 'special entry'}, not a file")
    size = info.get("size")
    if size is None or size > limit:
        raise ControlFileError(path, f"holds {size} bytes, more than the {limit} such a file may")
    data = fs.cat_file(path, start=0, end=limit + 1)
    if len(data) > limit:
        raise ControlFileError(path, f"holds more than the {limit} bytes such a file may")
    return data


def _read_local_control_file(path: str, limit: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ELOOP:
            target = escape_untrusted(os.readlink(path))
            raise ControlFileError(path, f"is a symbolic link (to {target}), not a file") from err
        raise
    try:
        mode = os.fstat(fd)
        if not stat.S_ISREG(mode.st_mode):
            raise ControlFileError(path, f"is a {_file_kind(mode.st_mode)}, not a regular file")
        if mode.st_size > limit:
            raise ControlFileError(path, f"holds {mode.st_size} bytes, more than the {limit} such a file may")
        handle = os.fdopen(fd, "rb")  # buffered: read(n) loops over short reads (NFS, FUSE)
    except BaseException:
        os.close(fd)
        raise
    chunks: list[bytes] = []
    got = 0
    with handle:  # in pieces: read(limit + 1) would allocate the whole limit for a file of a few bytes
        while got <= limit:
            chunk = handle.read(min(_CONTROL_READ_CHUNK, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    data = b"".join(chunks)
    if len(data) > limit:
        raise ControlFileError(path, f"holds more than the {limit} bytes such a file may")
    return data


def write_bytes_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write a small file so that readers see either nothing or all of it.

    Local files go through a temporary name and `os.replace`; object stores
    make a single PUT visible atomically already.
    """
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.tmp-{os.getpid()}"
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


def read_control_lines(
    url: str, name: str, storage: StorageConfig | None = None, limit: int = CONTROL_FILE_MAX_BYTES
) -> tuple[str, list[tuple[int, str]]]:
    """The path of the JSON-lines control file `name` in folder `url` and its non-blank lines, each with its line
    number from 1 ([] when the file is absent); read as `read_control_file` reads (ControlFileError otherwise)."""
    fs, root = filesystem(url, storage)
    path = join(root, name)
    try:
        raw = read_control_file(fs, path, limit)
    except FileNotFoundError:
        return path, []
    lines = enumerate(raw.decode(errors="replace").splitlines(), start=1)
    return path, [(number, text) for number, text in lines if text.strip()]


def append_control_line(
    url: str, name: str, line: str, storage: StorageConfig | None = None, limit: int = CONTROL_FILE_MAX_BYTES
) -> None:
    """Add `line` to the JSON-lines control file `name` in folder `url`, rewriting the file whole (object stores
    cannot append; readers never see half a line)."""
    fs, root = filesystem(url, storage)
    path = join(root, name)
    try:
        old = read_control_file(fs, path, limit)
    except FileNotFoundError:
        old = b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    write_bytes_atomic(fs, path, old + (line + "\n").encode())
