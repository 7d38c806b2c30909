"""Acceptance by a table of checks (checks.py) and checkpoint-restore drills, run through the launchers."""
