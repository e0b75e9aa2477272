"""policyworker's errors across vLLM's process boundary, and back to their types.

vLLM hands a controller only the *text* of a worker's error (``LLM``: a plain
``Exception("Call to collective_rpc method failed: Worker failed with error '...'")``;
``vllm serve``: the text in an HTTP error body). So every error the ``"policyworker"``
backend raises inside a vLLM worker carries, after its human-readable text, one
structured marker that this module writes and reads back::

    RefitTimeout: vLLM rank 1: refit timed out ... [policyworker-error:eyJ0eXBlIjoi...]

The marker is URL-safe base64 of a JSON object (the error's class name in
:mod:`policyworker.errors`, its message and its JSON-safe attributes: ``rank``,
``transport``, ``param``, ...), so no quoting on the way (``repr``, JSON, HTTP) can
break it. Only the marker is parsed, never the free text, and only classes of
:mod:`policyworker.errors` are rebuilt.

Controllers::

    from policyworker.integrations.vllm.errors import typed_errors
    with typed_errors():                       # re-raises the worker's error as its own class
        llm.update_weights({"update_info": {"version": v}})

This module imports neither vLLM nor torch: an HTTP controller can use it alone.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

from policyworker import errors as _errors
from policyworker.errors import PolicyWorkerError

__all__ = ["MARKER", "engine_error", "error_from_text", "mark", "typed_errors"]

MARKER = "[policyworker-error:"
_MARKER_RE = re.compile(re.escape(MARKER) + r"([A-Za-z0-9_\-=]+)\]")
_BASE_ATTRS = ("rank", "transport", "param")


def _json_safe(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_json_safe(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _json_safe(v) for k, v in value.items())
    return False


def encode(exc: PolicyWorkerError, message: str | None = None) -> str:
    """The marker for ``exc`` (its class, ``message`` or its own, its JSON-safe attributes)."""
    attrs = {k: v for k, v in vars(exc).items() if not k.startswith("_") and _json_safe(v)}
    record = {"type": type(exc).__name__, "message": str(exc) if message is None else message, "attrs": attrs}
    payload = base64.urlsafe_b64encode(json.dumps(record, separators=(",", ":")).encode()).decode()
    return f"{MARKER}{payload}]"


def mark(exc: PolicyWorkerError) -> PolicyWorkerError:
    """Give ``exc`` the text vLLM will carry: ``"Type: message [marker]"`` (idempotent)."""
    text = str(exc)
    if _MARKER_RE.search(text):
        return exc
    message = text
    exc.args = (f"{type(exc).__name__}: {message} {encode(exc, message)}",)
    return exc


def _decode(payload: str) -> dict[str, Any] | None:
    try:
        record = json.loads(base64.urlsafe_b64decode(payload.encode()))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        return None
    return record


def error_from_text(text: str) -> PolicyWorkerError | None:
    """Rebuild the policyworker error whose marker ``text`` carries (None if it carries none).

    The first marker wins (vLLM's wrapper text around it is ignored). The rebuilt error
    is an instance of the class named in the marker (a :class:`PolicyWorkerError`
    subclass from :mod:`policyworker.errors`), with the worker's message and attributes.
    """
    for match in _MARKER_RE.finditer(text):
        record = _decode(match.group(1))
        if record is None:
            continue
        cls = getattr(_errors, record["type"], None)
        if not (isinstance(cls, type) and issubclass(cls, PolicyWorkerError)):
            cls = PolicyWorkerError
        err = cls(str(record.get("message", "")))
        attrs = record.get("attrs")
        for key, value in (attrs.items() if isinstance(attrs, dict) else ()):
            if isinstance(key, str) and not key.startswith("_"):
                setattr(err, key, value)
        return err
    return None


def engine_error(exc: BaseException) -> PolicyWorkerError | None:
    """The policyworker error behind an exception vLLM raised to the controller (or None).

    ``exc`` is what ``LLM`` / ``AsyncLLM`` raised (vLLM's wrapper ``Exception``, or our
    own error where vLLM runs in the caller's process); its text and the text of its
    causes are searched for the marker.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PolicyWorkerError):
            return error_from_text(str(current)) or current
        found = error_from_text(str(current))
        if found is not None:
            return found
        current = current.__cause__ or current.__context__
    return None


@contextlib.contextmanager
def typed_errors() -> Iterator[None]:
    """Re-raise an error of the ``"policyworker"`` backend as its policyworker class.

    Wrap vLLM's weight-transfer calls (``init_weight_transfer_engine``,
    ``start_weight_update``, ``update_weights``, ``finish_weight_update``; ``LLM`` or
    ``AsyncLLM``) and catch :class:`~policyworker.errors.RefitTimeout`,
    :class:`~policyworker.errors.PeerLost`, :class:`~policyworker.errors.ConfigError`
    ... as usual. vLLM's own exception stays the ``__cause__``; an error without our
    marker (vLLM's own failures) propagates unchanged.
    """
    try:
        yield
    except Exception as exc:
        err = engine_error(exc)
        if err is None or err is exc:
            raise
        raise err from exc
