"""Fixtures for the services' tests."""

import pytest

from scheduler.services.claim import job_claim


@pytest.fixture
def running(member_setup, submit):
    """Given a job of alice's, claimed by worker w1."""
    alice, _, a, _, _ = member_setup
    submit(alice, a)
    (claim,) = job_claim(worker="w1", limit=1).claims
    return claim
