"""decisions.jsonl: the restart policy's decisions for a job, one per failure, in the run's output folder.

The one module that spells the file's name: the launch step appends through `append_decision`, drills, the CLI
and the tests read through `read_decisions`.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from tasks.recovery.policy import Decision
from training.storage import StorageConfig, append_control_line, read_control_lines

DECISIONS_FILE = "decisions.jsonl"


class DecisionFileError(ValueError):
    """decisions.jsonl holds a line that is not a Decision."""

    def __init__(self, path: str, line: int, problem: str) -> None:
        super().__init__(f"{path} line {line}: {problem}; only the launch step writes it: remove the line if it was "
                         "edited by hand")  # fmt: skip
        self.path, self.line, self.problem = path, line, problem


_LIMIT = 16 << 20  # a decision per failure: far below this


def append_decision(output_url: str, decision: Decision, storage: StorageConfig | None = None) -> None:
    """Add `decision` to the run's decisions.jsonl (rewritten whole: object stores cannot append)."""
    append_control_line(output_url, DECISIONS_FILE, decision.model_dump_json(by_alias=True), storage, _LIMIT)


def read_decisions(output_url: str, storage: StorageConfig | None = None) -> list[Decision]:
    """Every decision of the run, oldest first ([] when there is none)."""
    path, lines = read_control_lines(output_url, DECISIONS_FILE, storage, _LIMIT)
    decisions = []
    for number, line in lines:
        try:
            decisions.append(Decision.model_validate(json.loads(line)))
        except (ValueError, ValidationError) as err:
            raise DecisionFileError(path, number, f"not a decision ({type(err).__name__})") from err
    return decisions
