"""The network settings a rank runs with: the collective timeout the launcher passes, and what ranks.json records.

The launcher renders the spec's `cluster.network` section into environment variables (NCCL_*, GLOO_*, and
TDEPLOY_COLLECTIVE_TIMEOUT_S for the process group's timeout). Only this module reads the timeout variable
on the training side; the launcher imports its name from here (so this module imports torch only where it must).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import Any

COLLECTIVE_TIMEOUT_ENV = "TDEPLOY_COLLECTIVE_TIMEOUT_S"
# The distributed variables a rank records: NCCL's, gloo's and torch's own (TORCH_NCCL_*, TORCH_DISTRIBUTED_*, ...).
RECORDED_PREFIXES = ("NCCL_", "GLOO_", "TORCH_")


def collective_timeout() -> timedelta | None:
    """The process group's timeout from TDEPLOY_COLLECTIVE_TIMEOUT_S; None = torch's default."""
    raw = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "")
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError as err:
        raise ValueError(
            f"{COLLECTIVE_TIMEOUT_ENV}={raw!r} is not a number of seconds; set cluster.network.collective_timeout_s"
        ) from err
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{COLLECTIVE_TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return timedelta(seconds=seconds)


def network_record(backend: str) -> dict[str, Any]:
    """This rank's network as ranks.json records it: the distributed variables it sees and its collective timeout."""
    from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout  # torch is not needed above

    timeout = collective_timeout()
    effective = timeout or (default_pg_nccl_timeout if backend == "nccl" else default_pg_timeout)
    return {
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(RECORDED_PREFIXES)},
        "collective_timeout_s": effective.total_seconds() if effective is not None else None,
        "collective_timeout_from": "cluster.network.collective_timeout_s" if timeout else "torch default",
    }
