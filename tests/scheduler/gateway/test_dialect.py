"""What every dialect shares (scheduler/gateway/dialect.py): the body is JSON the database can
store, or a 400."""

import pytest

from scheduler.gateway.dialect import parse_body
from scheduler.gateway.errors import GatewayError


@pytest.mark.parametrize(
    "raw",
    [
        b"{nope",
        b'{"model": "m", "stop": Infinity}',
        b'{"temperature": NaN}',
        b'{"model": "m", "messages": [{"role": "user", "content": "a\\u0000b"}]}',
        b'{"model\\u0000": "m"}',
    ],
)
def test_bodies_the_database_could_not_store_are_refused(raw):
    with pytest.raises(GatewayError) as caught:
        parse_body(raw)
    assert caught.value.status == 400
