"""Fixtures of the plugin's own tests (the root tests/conftest.py does not apply here).

anyio backends (asyncio, asyncio+uvloop), a private runtime dir per test, and a check
that the plugin is installed as a distribution: the tests drive it by its entry-point
name, exactly as a user would, so a missing install is a loud failure, not a skip.
"""

from __future__ import annotations

import importlib.metadata as md
import os

import pytest

_BACKENDS = [pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio")]
try:
    import uvloop  # noqa: F401

    _BACKENDS.append(pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"))
except ImportError:  # uvloop is optional on platforms without it
    pass


@pytest.fixture(params=_BACKENDS)
def anyio_backend(request):
    return request.param


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path_factory, monkeypatch):
    path = tmp_path_factory.mktemp("pw-runtime")
    os.chmod(path, 0o700)
    monkeypatch.setenv("POLICYWORKER_RUNTIME_DIR", str(path))
    return path


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
