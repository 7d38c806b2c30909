"""Drills of the recovery ladder (issue 41), one module per rung."""
