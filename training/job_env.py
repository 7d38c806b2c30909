"""The names a launcher hands a job's ranks: environment variables and default paths.

Kept apart from the modules that read them (training/replica.py, training/checkpoint/memory.py), which import
torch, so that the launchers and the spec (tasks/launch/) name them without importing it.
"""

from __future__ import annotations

REPLICA_GROUP_ENV = "TDEPLOY_REPLICA_GROUP"
"""The index of this process's replica group (0 .. replica_groups-1), set by the launcher."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""The lighthouse's address (http://host:port), set by the launcher; torchft reads the same name."""
HOST_ENV = "TDEPLOY_REPLICA_HOST"
"""The address this node's replica-group servers listen on and advertise (the one its rendezvous uses), set by
the launcher."""
DEFAULT_MEMORY_DIR = "/dev/shm/tdeploy-memory"
"""Where the in-memory checkpoint tier keeps its host-memory copies when checkpoint.memory_dir is not set."""
