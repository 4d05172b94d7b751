"""Options of the GPU tests (registered when pytest is given tests/gpu, as the device stages do)."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fake-pg-out",
        default=None,
        help="a JSON-lines file the fake-process-group tests append each rank's measured step to (bench stages)",
    )


@pytest.fixture
def fake_pg_out(request: pytest.FixtureRequest):
    """Append one result (a dict) to `--fake-pg-out` when given; a no-op otherwise."""
    import json

    path = request.config.getoption("--fake-pg-out", default=None)

    def append(result: dict) -> None:
        if path:
            with Path(path).open("a") as f:
                f.write(json.dumps(result) + "\n")

    return append
