"""Log hygiene for runs driven from the CLI or a worker: a user error is shown once, without a traceback."""

from __future__ import annotations


def install_user_error_filter() -> None:
    """Install the filter on Prefect's run loggers (idempotent)."""
