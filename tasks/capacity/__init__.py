"""Capacity planning: will a job fit, how to lay it out, how long it takes (plain Python; `task.py` wraps it)."""
