"""Preemption: what the trainer does on a scheduler's termination or warning signal, and how it says so.

The contract with the launchers: on SIGTERM (Slurm preemption, Kubernetes eviction, torchrun's shutdown) or
SIGUSR1 (Slurm's `--signal=USR1@N` warning before the time limit), every rank finishes its current step, the
job writes a checkpoint (the usual commit protocol), rank 0 appends one JSON line to
`<output_dir>/preemptions.jsonl`, and every worker exits with PREEMPTED_EXIT_CODE ("requeue me").
"""

from __future__ import annotations

PREEMPTED_EXIT_CODE = 75
"""EX_TEMPFAIL (sysexits.h): the job stopped on request after saving; run it again to go on."""
PREEMPTIONS_FILE = "preemptions.jsonl"
"""One JSON object per preemption, appended by rank 0: step, signal, signal_to_exit_s, checkpoint, time."""
