"""Prefect flows and the tdeploy command line."""
