"""Typed errors shared by the pipeline steps, and the retry rule of their Prefect tasks.

A step raises `UserError` (bad input, a failed check: never retried) or
`TransientError` (storage, network, scheduler hiccups: retried with backoff).
Messages say what is wrong, the value, and the fix.
"""

from __future__ import annotations

from typing import Any

from training.storage import no_space_message


class DeployError(Exception):
    """A pipeline step failed; `fix` tells the user what to do."""

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(f"{message}; {fix}" if fix else message)
        self.message, self.fix = message, fix


class UserError(DeployError):
    """Bad input or a failed check: retrying cannot help."""


class TransientError(DeployError):
    """A failure that may pass on its own (connection reset, endpoint briefly down)."""


def retry_on_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: retry only when the task failed with a TransientError."""
    try:
        state.result()
    except TransientError:
        return True
    except Exception:  # noqa: BLE001 - any other failure is final by design
        return False
    return False


def is_connection_error(exc: BaseException) -> bool:
    """True for network failures that may pass (refused, reset, timed out, endpoint down); not for missing files."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    # botocore / aiohttp / requests connection failures, matched by name so none of them is a hard dependency
    return bool(
        names
        & {
            "EndpointConnectionError",
            "ConnectTimeoutError",
            "ReadTimeoutError",
            "ClientConnectorError",
            "ClientConnectionError",
            "ServerDisconnectedError",
            "ConnectionClosedError",
        }
    )


class NoSpaceError(UserError):
    """A step's write ran out of disk space (ENOSPC or a quota) at `url`; the sizes where they are known."""

    def __init__(self, url: str, what: str, needed_bytes: int | None, free_bytes: int | None, fix: str) -> None:
        super().__init__(no_space_message(url, what, needed_bytes, free_bytes), fix)
        self.url, self.what, self.needed_bytes, self.free_bytes = url, what, needed_bytes, free_bytes
        self._args = (url, what, needed_bytes, free_bytes, fix)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle by the constructor's arguments (Prefect stores a failed task's exception)."""
        return (type(self), self._args)
