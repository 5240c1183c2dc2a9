"""How many times a Redis client retries a dropped or refused connection (``connect(retries=)``).

The retries themselves against a real Redis: tests/integration/test_queue.py (a restart ridden out)
and tests/integration/test_secure_links.py (refusals raised once the retries are spent).
"""

from __future__ import annotations

import pytest

from services.common.config import ConfigError
from services.common.queue import REDIS_RETRIES, connect


def _retries(client) -> int:
    return client.get_connection_kwargs()["retry"].get_retries()


async def test_a_client_retries_twelve_times_unless_told_otherwise() -> None:
    default, one = connect("redis://127.0.0.1:1/0"), connect("redis://127.0.0.1:1/0", retries=1)
    try:
        assert REDIS_RETRIES == 12 and _retries(default) == 12 and _retries(one) == 1
    finally:
        await default.aclose()
        await one.aclose()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_a_bad_retry_count_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ConfigError, match="redis retries: want a whole number >= 0"):
        connect("redis://127.0.0.1:1/0", retries=bad)  # type: ignore[arg-type]
