"""Concurrency tests share the process helpers of tests/processes.py (the `processes` fixture is in
tests/conftest.py)."""

from tests.processes import database_url_for_tests, free_port, http_json, wait_until

__all__ = ["database_url_for_tests", "free_port", "http_json", "wait_until"]
