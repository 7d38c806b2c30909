"""Goodput as reports, the ledger and the CLI take it: the share of an allocation's time that became kept training
progress, and each badput kind's share (definitions after Google's ml-goodput-measurement; the computation is
training/goodput.py's, which the payload also uses for its live gauges), and `GoodputField`, the type by which
typed reports and the ledger hold it."""

from typing import Annotated, Any

from pydantic import PlainSerializer, PlainValidator

from training.goodput import (
    BADPUT_KINDS,
    AttemptTiming,
    Goodput,
    GoodputError,
    GoodputInputs,
    StepTiming,
    goodput_inputs_of_run,
    goodput_of,
    goodput_of_run,
)



def _goodput(value: Any) -> Goodput:
    return value if isinstance(value, Goodput) else Goodput.from_json(value)


GoodputField = Annotated[Goodput, PlainValidator(_goodput), PlainSerializer(Goodput.to_json, return_type=dict)]
"""A Goodput in a pydantic model: read from and written as `Goodput.to_json()` (goodput share included)."""

__all__ = [
    "GoodputField",
    "BADPUT_KINDS",
    "AttemptTiming",
    "Goodput",
    "GoodputError",
    "GoodputInputs",
    "StepTiming",
    "goodput_inputs_of_run",
    "goodput_of",
    "goodput_of_run",
]
