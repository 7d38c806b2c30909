"""Acceptance tests along six dimensions and checkpoint-restore drills, run through the launchers."""
