"""Shared fixtures: anyio backends (asyncio, asyncio+uvloop), a private runtime dir
(both from :mod:`policyworker.testing.fixtures`, which plugins' suites use too)."""

from __future__ import annotations

from policyworker.testing.fixtures import _private_runtime_dir, anyio_backend  # noqa: F401
