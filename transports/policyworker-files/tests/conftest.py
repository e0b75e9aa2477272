"""Fixtures of the plugin's own tests (the root tests/conftest.py does not apply here).

anyio backends (asyncio, asyncio+uvloop), a private runtime dir per test, and a check
that the plugin is installed as a distribution: the tests drive it by its entry-point
name, exactly as a user would, so a missing install is a loud failure, not a skip.
"""

from __future__ import annotations

import importlib.metadata as md

import pytest

from policyworker.testing.fixtures import _private_runtime_dir, anyio_backend  # noqa: F401


@pytest.fixture(autouse=True, scope="session")
def _plugin_installed():
    try:
        md.distribution("policyworker-files")
    except md.PackageNotFoundError:
        pytest.fail("policyworker-files is not installed: pip install -e transports/policyworker-files "
                    "(scripts/setup.sh does)", pytrace=False)
    names = {ep.name for ep in md.entry_points(group="policyworker.transports")}
    if "files" not in names:
        pytest.fail("policyworker-files is installed but registers no 'files' transport", pytrace=False)
