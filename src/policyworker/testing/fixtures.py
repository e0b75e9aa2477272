"""Pytest fixtures shared by this project's test suites (the root ``tests/`` and each
out-of-tree plugin's ``tests/``): a conftest imports them by name.

``anyio_backend``: every anyio test runs on asyncio and, where installed, on
asyncio + uvloop. ``_private_runtime_dir`` (autouse): each test gets its own 0700
runtime dir, so IPC paths never collide across tests.
"""

from __future__ import annotations

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
    """Each test gets its own 0700 runtime dir, so IPC paths never collide across tests."""
    # Short: a socket path (runtime dir + "policyworker-GPU-<uuid>-<pair>.sock") must stay
    # under the platform's 107 bytes even deep in pytest's numbered temp dirs.
    path = tmp_path_factory.mktemp("rt")
    os.chmod(path, 0o700)
    monkeypatch.setenv("POLICYWORKER_RUNTIME_DIR", str(path))
    return path
