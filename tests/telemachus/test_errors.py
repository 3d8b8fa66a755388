"""Domain errors outside the API: a ValidationFailed raised to code that called a service
directly (a shell, governed_slot, a task) says why in its message, not only "Invalid input."; the
API's body keeps its shape."""

import pytest

from scheduler import governed_slot
from telemachus.errors import ValidationFailed


def test_the_message_carries_each_fields_reason():
    assert str(ValidationFailed({"team": ["No team 'x' that you belong to."]})) == (
        "Invalid input. team: No team 'x' that you belong to."
    )
    nested = ValidationFailed({"input": {"arguments": ["'say' is required."]}, "priority": ["At most 5."]})
    assert str(nested) == "Invalid input. input.arguments: 'say' is required.; priority: At most 5."
    bulk = ValidationFailed({"jobs": [{}, {"type": ["Not a job type."]}]}, detail="Job 1 is invalid.")
    assert str(bulk) == "Job 1 is invalid. jobs[1].type: Not a job type."


def test_the_api_body_is_unchanged():
    failed = ValidationFailed({"team": ["No team 'x' that you belong to."]})
    assert failed.body() == {
        "error": "validation_error",
        "detail": "Invalid input.",
        "fields": {"team": ["No team 'x' that you belong to."]},
    }


@pytest.mark.django_db
def test_a_service_refusal_reaches_app_code_with_its_reason(member_setup):
    alice = member_setup[0]
    with pytest.raises(ValidationFailed, match="team: No team 'research' that you belong to"):
        with governed_slot(user=alice, team="research", model="m"):
            pass
