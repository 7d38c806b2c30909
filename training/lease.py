"""Exclusive leases on storage roots: one job at a time writes a run's outputs and checkpoints.

A lease is `LEASE.json` in the root. It names its holder (host, pid and the pid's
start time, job id) and an expiry that a heartbeat thread moves forward every
ttl/3 while the holder lives. A second job finds it and is refused with who holds
it and since when. A lease is stale, and is taken over with a warning naming the
old holder, when it has expired, or when its holder ran in this machine's pid space
and that process is gone. The same job (a torchrun restart) takes its own lease
back without a warning.

How two contenders are kept from both winning:

- local folders: each read-decide-write happens under `flock` of `.LEASE.lock` in
  the root (exclusive between processes of one host, and across hosts on NFS with
  working locks); the record itself is replaced atomically;
- S3: conditional PUTs: create with `If-None-Match: *`, renew, take over and
  release with `If-Match: <ETag of what we read>`, so exactly one writer wins;
- other object stores (and S3 servers that ignore the conditions): write, wait
  `settle_s`, read back, keep the lease only if our token is there. Residual race:
  two writers that both read "no lease" and write within less than the settle
  window of each other on a store without read-after-write consistency could both
  see their own token at different moments; a later renewal of the loser finds the
  winner's token and reports the lease lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Annotated, Any, Protocol

import fsspec
from fsspec.asyn import sync
from fsspec.implementations.local import LocalFileSystem
from pydantic import AfterValidator, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from training import process
from training.config import first_problem
from training.storage import (
    CONTROL_FILE_MAX_BYTES,
    ControlFileError,
    StorageConfig,
    filesystem,
    is_local,
    join,
    read_control_file,
    write_bytes_atomic,
)
from training.untrusted import escape_untrusted

log = logging.getLogger(__name__)

LEASE_FILE = "LEASE.json"
LOCK_FILE = ".LEASE.lock"
DEFAULT_TTL_S = 60.0


MAX_UNIX_S = 253402300799.0
"""9999-12-31T23:59:59Z, the last second `time.gmtime` and strftime spell: a later time in a record is forged."""
MAX_PID = 2**31 - 1
"""The largest pid a kernel hands out (Linux's pid_max is at most 2**22) that os.kill still takes."""


def _iso(unix_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_s))


def _printable(value: str) -> str:
    if not value.isprintable():
        raise ValueError("holds a control or other non-printable character")
    return value


# A record is untrusted (anyone who can write the storage can write one): every field typed, bounded and finite.
_Name = Annotated[str, Field(strict=True, max_length=256), AfterValidator(_printable)]
_UnixS = Annotated[float, Field(strict=True, ge=0, le=MAX_UNIX_S)]


@dataclass(frozen=True, config=ConfigDict(extra="forbid", allow_inf_nan=False))
class LeaseRecord:
    """The content of LEASE.json: who holds the root, since when, until when (validated when built or read)."""

    url: Annotated[str, Field(strict=True, max_length=4096)]  # never shown: messages use the job's own URL
    job_id: _Name
    host: Annotated[str, Field(strict=True, min_length=1, max_length=255), AfterValidator(_printable)]
    pid: Annotated[int, Field(strict=True, ge=1, le=MAX_PID)]
    pid_start_time: _Name | None
    boot_id: _Name | None
    pid_namespace: _Name | None
    token: _Name
    started_unix_s: _UnixS
    renewed_unix_s: _UnixS
    expires_unix_s: _UnixS

    def describe(self) -> str:
        """`pid P on host H (job J) since T (expires E)`, the holder's names escaped."""
        return (
            f"pid {self.pid} on host {escape_untrusted(self.host)} (job {escape_untrusted(self.job_id)}) "
            f"since {_iso(self.started_unix_s)} (expires {_iso(self.expires_unix_s)})"
        )

    def machine(self) -> process.Machine:
        """Where the holder's pid means something."""
        return process.Machine(self.host, self.boot_id, self.pid_namespace)

    def to_bytes(self) -> bytes:
        """As JSON."""
        return json.dumps(asdict(self), indent=2).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LeaseRecord:
        """Inverse of to_bytes; ValueError (its text safe to log) if it is not a well-formed lease record."""
        try:
            value = json.loads(data)
        except (ValueError, RecursionError) as err:  # JSON, UTF-8 and int-digit errors are ValueErrors
            raise ValueError(f"not a lease record: not JSON ({type(err).__name__})") from err
        if not isinstance(value, dict):
            raise ValueError(f"not a lease record: a JSON {type(value).__name__}, not an object")
        try:
            return _RECORD.validate_python(value)
        except ValidationError as err:
            raise ValueError(f"not a lease record: {escape_untrusted(first_problem(err, '<record>'))}") from err


_RECORD = TypeAdapter(LeaseRecord)


class LeaseHeld(RuntimeError):
    """Another live job holds the lease; says who, since when, and what to do."""

    def __init__(self, label: str, url: str, holder: LeaseRecord) -> None:
        super().__init__(
            f"{label}={url}: held by {holder.describe()}; wait for it, cancel that job, or use another {label}"
        )
        self.label, self.url, self.holder = label, url, holder


class LeaseLost(RuntimeError):
    """Our lease was taken over by another job (we stopped renewing it long enough for it to expire)."""

    def __init__(self, label: str, url: str, holder: LeaseRecord | None) -> None:
        who = holder.describe() if holder else "nobody (it was removed)"
        super().__init__(
            f"{label}={url}: this job's lease was taken over, it is now held by {who}; "
            "stop this job: two jobs must not write one root"
        )
        self.label, self.url, self.holder = label, url, holder


class _Store(Protocol):
    """Lease file operations; `version` is what a conditional write compares against."""

    def read(self) -> tuple[bytes, str] | None: ...

    def create(self, data: bytes, token: str) -> str | None: ...

    def replace(self, data: bytes, token: str, version: str) -> str | None: ...

    def delete(self, version: str) -> None: ...


def _token_of(data: bytes) -> str:
    try:
        return LeaseRecord.from_bytes(data).token
    except ValueError:
        return ""


class _LocalStore:
    """A local folder: flock serialises lease operations, os.replace publishes whole records."""

    def __init__(self, fs: LocalFileSystem, root: str) -> None:
        self.fs, self.root, self.path = fs, root, os.path.join(root, LEASE_FILE)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(os.path.join(self.root, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _read(self) -> tuple[bytes, str] | None:
        try:
            data = read_control_file(self.fs, self.path)
        except FileNotFoundError:
            return None
        return data, _token_of(data)

    def read(self) -> tuple[bytes, str] | None:
        with self._locked():
            return self._read()

    def create(self, data: bytes, token: str) -> str | None:
        with self._locked():
            if os.path.exists(self.path):
                return None
            write_bytes_atomic(self.fs, self.path, data)
            return token

    def replace(self, data: bytes, token: str, version: str) -> str | None:
        with self._locked():
            current = self._read()
            if current is None or current[1] != version:
                return None
            write_bytes_atomic(self.fs, self.path, data)
            return token

    def delete(self, version: str) -> None:
        with self._locked():
            current = self._read()
            if current is not None and current[1] == version:
                os.unlink(self.path)


class _ReadBackStore:
    """Any fsspec store: write, let it settle, read back; ours only if our token is there (see the module doc)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, settle_s: float) -> None:
        self.fs, self.path, self.settle_s = fs, path, settle_s

    def read(self) -> tuple[bytes, str] | None:
        try:
            data = read_control_file(self.fs, self.path)
        except FileNotFoundError:
            return None
        return data, _token_of(data)

    def _write_and_confirm(self, data: bytes, token: str) -> str | None:
        write_bytes_atomic(self.fs, self.path, data)
        time.sleep(self.settle_s)
        current = self.read()
        return token if current is not None and current[1] == token else None

    def create(self, data: bytes, token: str) -> str | None:
        if self.fs.exists(self.path):
            return None
        return self._write_and_confirm(data, token)

    def replace(self, data: bytes, token: str, version: str) -> str | None:
        current = self.read()
        if current is None or current[1] != version:
            return None
        if token == version:  # a renewal: nobody else writes a record with our token
            write_bytes_atomic(self.fs, self.path, data)
            return token
        return self._write_and_confirm(data, token)

    def delete(self, version: str) -> None:
        current = self.read()
        if current is not None and current[1] == version:
            self.fs.rm_file(self.path)


def _s3_error_code(err: BaseException) -> str | None:
    """The S3 error code behind an s3fs exception (s3fs keeps botocore's ClientError as the cause)."""
    seen: BaseException | None = err
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            return response.get("Error", {}).get("Code")
        seen = seen.__cause__ or seen.__context__
    return None


_CONDITION_FAILED = {"PreconditionFailed", "ConditionalRequestConflict"}
_NOT_SUPPORTED = {"NotImplemented", "InvalidArgument", "InvalidRequest"}


class _S3Store:
    """S3 with conditional PUT and DELETE (If-None-Match / If-Match on the ETag); read-back where refused."""

    def __init__(self, fs: Any, path: str, settle_s: float) -> None:
        self.fs, self.path = fs, path
        self.bucket, self.key, _ = fs.split_path(path)
        self.fallback = _ReadBackStore(fs, path, settle_s)
        self.conditional = True

    def read(self) -> tuple[bytes, str] | None:
        if not self.conditional:
            return self.fallback.read()

        async def get() -> tuple[bytes, str]:
            response = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            async with response["Body"] as body:
                size = response.get("ContentLength")
                if not isinstance(size, int) or size > CONTROL_FILE_MAX_BYTES:
                    raise ControlFileError(
                        f"s3://{self.path}", f"holds {size} bytes, more than the {CONTROL_FILE_MAX_BYTES} it may"
                    )
                return await body.read(), response["ETag"]

        try:
            return sync(self.fs.loop, get)
        except FileNotFoundError:
            return None

    def _put(self, data: bytes, token: str, **condition: str) -> str | None:
        """A conditional PUT; None when the condition failed; NotImplementedError when the server refuses it."""
        try:
            self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=data, **condition)
        except OSError as err:
            code = _s3_error_code(err)
            if code in _CONDITION_FAILED:
                return None
            if code in _NOT_SUPPORTED:
                log.warning("s3://%s: the server refuses conditional writes (%s); using read-back leases",
                            self.path, code)  # fmt: skip
                self.conditional = False
                raise NotImplementedError(code) from err
            raise
        current = self.read()  # a server that ignores the condition shows another writer's token here
        return current[1] if current is not None and _token_of(current[0]) == token else None

    # After a refusal, None makes the caller read again: versions are then read-back tokens, not ETags.
    def create(self, data: bytes, token: str) -> str | None:
        if not self.conditional:
            return self.fallback.create(data, token)
        try:
            return self._put(data, token, IfNoneMatch="*")
        except NotImplementedError:
            return None

    def replace(self, data: bytes, token: str, version: str) -> str | None:
        if not self.conditional:
            return self.fallback.replace(data, token, version)
        try:
            return self._put(data, token, IfMatch=version)
        except NotImplementedError:
            return None

    def delete(self, version: str) -> None:
        if not self.conditional:
            self.fallback.delete(version)
            return
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.key, IfMatch=version)
        except FileNotFoundError:
            return
        except OSError as err:
            code = _s3_error_code(err)
            if code in _CONDITION_FAILED:
                return  # no longer ours: leave it
            if code not in _NOT_SUPPORTED:
                raise
            current = self.read()
            if current is not None and current[1] == version:
                self.fs.rm_file(self.path)


def _store(url: str, storage: StorageConfig | None, settle_s: float) -> _Store:
    fs, root = filesystem(url, storage)
    if is_local(url):
        return _LocalStore(fs, root)
    path = join(root, LEASE_FILE)
    if url.split("://", 1)[0] in ("s3", "s3a"):
        return _S3Store(fs, path, settle_s)
    return _ReadBackStore(fs, path, settle_s)


class Lease:
    """An exclusive, renewed lease on one storage root; a context manager (acquire on enter, release on exit)."""

    def __init__(
        self,
        url: str,
        storage: StorageConfig | None = None,
        *,
        label: str = "url",
        job_id: str | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        settle_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url, self.label, self.ttl_s, self.clock = url, label, ttl_s, clock
        self.job_id = job_id or f"{process.machine().host}-{os.getpid()}"
        self._store = _store(url, storage, settle_s)
        self._record: LeaseRecord | None = None
        self._version: str | None = None
        self._lost: LeaseLost | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._mutex = threading.Lock()

    # ---- state ------------------------------------------------------------------------------

    @property
    def held(self) -> bool:
        """Acquired, not released, not lost."""
        return self._record is not None and self._lost is None

    @property
    def record(self) -> LeaseRecord | None:
        """What we last wrote."""
        return self._record

    def check(self) -> None:
        """Raise LeaseLost if another job took the lease over."""
        if self._lost is not None:
            raise self._lost

    def holder(self) -> LeaseRecord | None:
        """The record in the root now (ours or not), None without one; an unreadable one raises ValueError."""
        current = self._store.read()
        return None if current is None else LeaseRecord.from_bytes(current[0])

    # ---- acquire, renew, release ------------------------------------------------------------

    def _new_record(self, token: str, started: float | None = None) -> LeaseRecord:
        me, now = process.machine(), self.clock()
        pid = os.getpid()
        return LeaseRecord(
            url=self.url, job_id=self.job_id, host=me.host, pid=pid, pid_start_time=process.start_time(pid),
            boot_id=me.boot_id, pid_namespace=me.pid_namespace, token=token,
            started_unix_s=now if started is None else started, renewed_unix_s=now, expires_unix_s=now + self.ttl_s,
        )  # fmt: skip

    def takeover_reason(self, holder: LeaseRecord) -> str | None:
        """Why `holder`'s lease may be taken over, or None while it is valid."""
        if holder.job_id == self.job_id:
            return "it is this job's own lease from an earlier attempt"
        if self.clock() > holder.expires_unix_s:
            return f"it expired at {_iso(holder.expires_unix_s)}"
        if process.machine().same_pid_space(holder.machine()) and not process.alive(holder.pid, holder.pid_start_time):
            return f"its holder pid {holder.pid} on {escape_untrusted(holder.host)} is gone"
        return None

    def acquire(self, attempts: int = 5) -> Lease:
        """Take the lease, or take over a stale one; LeaseHeld when a live job holds it. Starts the heartbeat."""
        token = secrets.token_hex(16)
        mine = self._new_record(token)
        for _ in range(attempts):
            current = self._store.read()
            if current is None:
                version = self._store.create(mine.to_bytes(), token)
                if version is not None:
                    return self._start(mine, version)
                continue  # someone created it between our read and write: look again
            data, version = current
            try:
                holder: LeaseRecord | None = LeaseRecord.from_bytes(data)
            except ValueError as err:
                holder, reason = None, f"its record is unreadable ({err})"
            else:
                reason = self.takeover_reason(holder)
                if reason is None:
                    raise LeaseHeld(self.label, self.url, holder)
            new_version = self._store.replace(mine.to_bytes(), token, version)
            if new_version is not None:
                if holder is not None and holder.job_id == self.job_id:
                    log.info("%s=%s: took back this job's lease (%s)", self.label, self.url, holder.describe())
                else:
                    who = holder.describe() if holder else "an unreadable record"
                    log.warning("%s=%s: took over a stale lease held by %s: %s", self.label, self.url, who, reason)
                return self._start(mine, new_version)
        holder = self.holder()
        if holder is None:
            raise RuntimeError(f"{self.label}={self.url}: could not create {LEASE_FILE} in {attempts} attempts")
        raise LeaseHeld(self.label, self.url, holder)

    def _start(self, record: LeaseRecord, version: str) -> Lease:
        self._record, self._version, self._lost = record, version, None
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._beat, name=f"lease-{self.label}", daemon=True)
        self._heartbeat.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except Exception as err:  # noqa: BLE001 - storage trouble: keep training, try again next beat
                log.warning("%s=%s: lease renewal failed, retrying in %.0fs: %s", self.label, self.url,
                            self.ttl_s / 3, err)  # fmt: skip

    def renew(self) -> bool:
        """Move the expiry forward; False (and LeaseLost on check()) when another job holds the lease now."""
        with self._mutex:
            if self._record is None or self._version is None or self._lost is not None:
                return False
            record = self._new_record(self._record.token, self._record.started_unix_s)
            version = self._store.replace(record.to_bytes(), record.token, self._version)
            if version is None:  # our last write may have landed without us seeing its version
                current = self._store.read()
                if current is not None and _token_of(current[0]) == record.token:
                    version = self._store.replace(record.to_bytes(), record.token, current[1])
            if version is None:
                holder = self._safe_holder()
                self._lost = LeaseLost(self.label, self.url, holder)
                log.error("%s", self._lost)
                return False
            self._record, self._version = record, version
            return True

    def _safe_holder(self) -> LeaseRecord | None:
        try:
            return self.holder()
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours; storage errors are logged, not raised."""
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=self.ttl_s)
        with self._mutex:
            if self._record is None or self._version is None:
                return
            version, self._record, self._version = self._version, None, None
            if self._lost is not None:
                return
            try:
                self._store.delete(version)
            except Exception as err:  # noqa: BLE001 - the job's own outcome matters more; the lease expires anyway
                log.warning("%s=%s: could not release the lease (it expires by itself): %s", self.label, self.url, err)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
