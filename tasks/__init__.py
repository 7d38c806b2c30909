"""Pipeline steps: plain Python logic with thin Prefect task wrappers."""
