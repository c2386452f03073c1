from __future__ import annotations

import pytest
from fake_engine import FakeEngine


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()
