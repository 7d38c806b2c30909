"""Errors of checkpoint saves and loads, and which failures are storage errors (worth a retry) rather than bugs."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from training.storage import is_no_space

# torch's zip writer reports a short write (the disk took fewer bytes than given) only as this.
SHORT_WRITE = "unexpected pos"

# botocore / aiohttp / urllib3 / requests network failures, matched by name so none is a hard dependency
_NETWORK_ERRORS = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "IncompleteReadError",
        "ResponseStreamingError",
        "ClientConnectorError",
        "ClientConnectionError",
        "ClientOSError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "ProtocolError",
        "NewConnectionError",
        "MaxRetryError",
    }
)

_RETRYABLE_S3_CODES = frozenset({"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling"})


class CheckpointSaveError(RuntimeError):
    """A save failed with storage errors after every retry; the previous complete checkpoint is still intact."""

    def __init__(
        self, path: str, attempts: int, cause: BaseException, no_space: bool = False, step: int | None = None
    ) -> None:
        super().__init__(f"checkpoint save to {path} failed after {attempts} attempt(s): {cause}")
        self.path, self.attempts, self.no_space, self.step = path, attempts, no_space, step


class CheckpointCommitError(CheckpointSaveError):
    """The save's own check after its commit: COMMIT.json does not list every file the ranks wrote, or a file it
    lists is not on storage as written. The commit is withdrawn (the checkpoint is partial), not retried: the
    same save would write the same record."""

    def __init__(self, path: str, step: int, problems: list[str]) -> None:
        cause = RuntimeError(f"the commit record does not match what was written: {'; '.join(problems)}")
        super().__init__(path, 1, cause, step=step)
        self.problems = problems


class CheckpointAbortedError(RuntimeError):
    """Another rank raised a non-storage error (a bug) inside the save; this rank stops with it."""

    def __init__(self, rank: int, error: str) -> None:
        super().__init__(f"checkpoint save aborted: rank {rank} raised {error} (not a storage error, so not retried)")
        self.rank, self.error = rank, error


class CheckpointFormatError(ValueError):
    """A checkpoint file is not what this module writes (train_state.json, an RNG file, COMMIT.json)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(
            f"{path} {problem}; the checkpoint was not written by this trainer or was altered: "
            "inspect it, and move the step folder away to resume from an older one"
        )
        self.path, self.problem = path, problem

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.problem))


class CheckpointCopyError(RuntimeError):
    """A checkpoint step could not be copied as committed (`copy_step`): the source is not committed, a file
    differs from its commit record, or the destination is taken. Nothing at the destination looks committed."""

    def __init__(self, path: str, problem: str, fix: str) -> None:
        super().__init__(f"{path} {problem}; {fix}")
        self.path, self.problem, self.fix = path, problem, fix

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.problem, self.fix))


def is_storage_error(exc: BaseException) -> bool:
    """True for storage and network failures (worth a retry); False for anything else, which is a bug.

    DCP's CheckpointException is judged by the per-rank failures it wraps: all of them must be storage errors.
    """
    return all(is_storage_leaf(leaf) for _, leaf in leaves(exc))


def leaves(exc: BaseException, rank: int | None = None) -> list[tuple[int | None, BaseException]]:
    """The underlying exceptions with the rank they came from; DCP's CheckpointException unwrapped."""
    if isinstance(exc, CheckpointException) and exc.failures:
        out: list[tuple[int | None, BaseException]] = []
        for failed_rank, failure in exc.failures.items():
            inner = failure[0] if isinstance(failure, tuple) else failure
            out.extend(leaves(inner, failed_rank) if isinstance(inner, BaseException) else [(failed_rank, exc)])
        return out
    return [(rank, exc)]


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and what it was raised from (explicit causes only: a bug inside an `except` block stays a bug)."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 16:
        chain.append(chain[-1].__cause__)
    return chain


def is_storage_leaf(exc: BaseException) -> bool:
    for err in _causes(exc):
        if isinstance(err, OSError):  # incl. ConnectionError, TimeoutError, FileNotFoundError, ENOSPC
            return True
        if {cls.__name__ for cls in type(err).__mro__} & _NETWORK_ERRORS:
            return True
        if isinstance(err, RuntimeError) and SHORT_WRITE in str(err):
            return True
        response = getattr(err, "response", None)  # botocore ClientError: a 5xx or throttling answer
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if code in _RETRYABLE_S3_CODES or int(status) >= 500:
                return True
    return False


def says_no_space(exc: BaseException) -> bool:
    return any(is_no_space(leaf) for _, leaf in leaves(exc))  # torch's short write hides the OSError in its context


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
