"""Run outputs of the trainer: per-rank JSON-lines metrics, sample records, ranks.json, result.json.

Files are written to a local folder. For a remote `output_url` the folder is a
local staging area that is uploaded with `sync()` at every log interval and at
the end, because object stores cannot append.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import torch

from training.storage import StorageConfig, filesystem, is_local, join, local_path


class RunOutput:
    """The run's output folder (local, or staged locally for a remote URL)."""

    def __init__(self, url: str, storage: StorageConfig) -> None:
        self.url, self.storage = url, storage
        self.remote = not is_local(url)
        self.dir = Path(tempfile.mkdtemp(prefix="tdeploy-out-")) if self.remote else Path(local_path(url))
        self.dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, IO[str]] = {}

    def append(self, name: str, record: dict[str, Any]) -> None:
        """Append one JSON line to `name` (relative to the output folder)."""
        handle = self._files.get(name)
        if handle is None:
            path = self.dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            # Line-buffered: watchers (stall detection, drills) see every step as it happens.
            handle = self._files[name] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        handle.write(json.dumps(record) + "\n")

    def write_json(self, name: str, data: Any) -> None:
        """Write a whole JSON document (atomically) to `name`."""
        path = self.dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, path)

    def sync(self) -> None:
        """Flush files; upload them when the output URL is remote."""
        for handle in self._files.values():
            handle.flush()
        if self.remote:
            fs, root = filesystem(self.url, self.storage)
            for path in self.dir.rglob("*"):
                if path.is_file() and not path.name.startswith("."):
                    fs.put_file(str(path), join(root, str(path.relative_to(self.dir))))

    def close(self) -> None:
        """Flush, upload and close."""
        self.sync()
        for handle in self._files.values():
            handle.close()
        self._files.clear()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated memory on a GPU, peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class CommTimer:
    """Times gradient reductions by wrapping a DDP communication hook.

    A reduction counts from the hook call until its future completes; the
    communication time of a step is the union of those intervals, so time that
    overlaps backward compute is attributed to communication (an upper bound of
    the exposed share).
    """

    def __init__(self) -> None:
        self._intervals: list[tuple[float, float]] = []

    def wrap(self, hook: Any) -> Any:
        """A comm hook that times `hook`."""

        # No annotations: DDP checks them and `from __future__ import annotations` makes them strings.
        def timed(state, bucket):  # noqa: ANN001, ANN202
            start = time.perf_counter()
            future = hook(state, bucket)

            def finished(fut):  # noqa: ANN001, ANN202
                self._intervals.append((start, time.perf_counter()))
                return fut.value()

            return future.then(finished)

        return timed

    def take(self) -> float:
        """Seconds with a reduction in flight since the last call."""
        total, end = 0.0, float("-inf")
        for start, stop in sorted(self._intervals):
            if stop <= end:
                continue
            total += stop - max(start, end)
            end = stop
        self._intervals.clear()
        return total
