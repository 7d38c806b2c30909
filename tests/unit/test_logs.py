"""A user error raised in a real Prefect flow is logged once, without a traceback; other errors keep theirs."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from prefect import flow, task

from tasks.errors import TransientError, UserError
from tasks.logs import PREFECT_RUN_LOGGERS, UserErrorFilter, install_user_error_filter

MESSAGE = "data.prepare.output_url=/nope: cannot be written; use a folder you can write"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def prefect_log() -> Iterator[_Collect]:
    handler = _Collect()
    logger = logging.getLogger("prefect")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _run(error: Exception) -> None:
    @task(retries=0)
    def fails() -> None:
        raise error

    @flow
    def user_flow() -> None:
        fails()

    state = user_flow(return_state=True)
    assert state.is_failed()


@pytest.mark.usefixtures("prefect_harness")
def test_a_user_error_shows_its_message_once_and_no_traceback(prefect_log: _Collect) -> None:
    install_user_error_filter()
    install_user_error_filter()
    for name in PREFECT_RUN_LOGGERS:
        assert sum(isinstance(f, UserErrorFilter) for f in logging.getLogger(name).filters) == 1
    _run(UserError(MESSAGE))
    text = "\n".join(prefect_log.lines)
    assert "Traceback" not in text, text
    assert text.count(MESSAGE) == 1, text
    assert "Finished in state Failed" in text


@pytest.mark.usefixtures("prefect_harness")
def test_a_transient_error_keeps_its_traceback(prefect_log: _Collect) -> None:
    install_user_error_filter()
    _run(TransientError("storage at http://127.0.0.1:9 refused the connection", "the step retries"))
    text = "\n".join(prefect_log.lines)
    assert "Traceback" in text
