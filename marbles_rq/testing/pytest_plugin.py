"""The pytest plugin of the test kit (the pytest11 entry point `marbles_rq`): the fixture
`mr_env`, an Environment (marbles_rq/testing/environment.py) for one test. Loaded in every
pytest session of every project that installs marbles-rq, so it imports nothing until a
test asks for the fixture."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .environment import Environment


@pytest.fixture
def mr_env() -> Iterator[Environment]:
    """A test kit Environment: workflows in memory on a virtual clock (no Redis)."""
    from .environment import Environment

    yield Environment()
