"""The deployment ledger (registry.py), the regression gate (gate.py) and rollback (rollback.py)."""
