"""Acceptance checks and data expectations over run artifacts (no Prefect)."""
