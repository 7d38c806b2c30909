"""Log hygiene for runs driven from the CLI or a worker: a user error is shown once, without a traceback."""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict

from tasks.errors import DeployError, TransientError

# The loggers Prefect's task and flow engines report a failed run on (with exc_info=True).
PREFECT_RUN_LOGGERS = ("prefect.task_runs", "prefect.flow_runs", "prefect.engine", "prefect.flow_engine")
# User-failure classes of modules that may not be imported (training/ pulls in torch): looked up in
# sys.modules when a record arrives, since an exception of a class implies its module is loaded.
_LAZY_USER_ERRORS = (
    ("training.dataset", "DatasetError"),
    ("training.checkpoint.errors", "CheckpointFormatError"),
    ("training.lease", "LeaseHeld"),
    ("training.checkpoint.trust", "UnsafeCheckpointError"),
    ("training.signing", "CheckpointKeyError"),
)
_SEEN_LIMIT = 256
_SEE_ABOVE = "(the error above)"


def is_user_error(exc: BaseException | None) -> bool:
    """True for failures that retrying cannot fix and that a message explains fully (no traceback needed)."""
    if exc is None or isinstance(exc, TransientError):
        return False
    if isinstance(exc, DeployError):
        return True
    for module_name, name in _LAZY_USER_ERRORS:
        cls = getattr(sys.modules.get(module_name), name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return True
    return False


def _escaped(text: str) -> str:
    """`text` as it appears inside an exception's repr (newlines and quotes escaped)."""
    return repr(text)[1:-1]


class UserErrorFilter(logging.Filter):
    """Strips the traceback from records about a user error, and shows each user error's text once per run.

    Prefect reports one failure as "Task run failed", the task's final state, "Encountered exception" of
    the flow and the flow's final state: the first keeps the message, the later ones point to it.
    """

    def __init__(self) -> None:
        super().__init__("tdeploy-user-errors")
        self._seen: OrderedDict[tuple[object, str], None] = OrderedDict()

    def filter(self, record: logging.LogRecord) -> bool:
        run = getattr(record, "flow_run_id", None)
        exc = record.exc_info[1] if isinstance(record.exc_info, tuple) else None
        if exc is not None and is_user_error(exc):
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            text = str(exc)
            if (run, text) in self._seen:
                return False
            self._remember(run, text)
            return True
        if not self._seen:
            return True
        message = record.getMessage()
        shown = [text for seen_run, text in self._seen if seen_run == run and text]
        for text in shown:
            for needle in (text, _escaped(text)):
                if needle in message:
                    message = message.replace(needle, _SEE_ABOVE)
        if message != record.getMessage():
            record.msg, record.args = message, ()
        return True

    def _remember(self, run: object, text: str) -> None:
        self._seen[(run, text)] = None
        while len(self._seen) > _SEEN_LIMIT:
            self._seen.popitem(last=False)


def install_user_error_filter() -> None:
    """Install the filter on Prefect's run loggers (idempotent)."""
    for name in PREFECT_RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, UserErrorFilter) for f in logger.filters):
            logger.addFilter(_FILTER)


_FILTER = UserErrorFilter()
