"""A model server's JSON is read strictly: what the database's JSON cannot hold is malformed."""

import pytest

from executors.drivers.openai import strict_json


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_numbers_that_are_not_finite_are_malformed(number):
    with pytest.raises(ValueError):
        strict_json('{"usage": {"prompt_tokens": NUMBER}}'.replace("NUMBER", number))


def test_finite_numbers_read_as_usual():
    assert strict_json('{"logprob": -1.5e-300, "big": 1e308, "n": 3}') == {"logprob": -1.5e-300, "big": 1e308, "n": 3}
