"""Node environment checks: consistent, reachable, ready nodes before any job starts (playbooks/check_nodes.yml)."""
