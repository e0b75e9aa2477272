"""Engines the ``sglang_ipc`` transport hands buckets to: the request, the contract, HTTP.

One refit is a series of ``update_weights_from_tensor`` calls, one per bucket, made by
the engine's gather source (its first trainer rank). Every call carries one entry per
engine tp rank. ``weight_version`` is set on the last bucket's call only, so an
engine reports version v only once every bucket of v has landed.

* :class:`SglangHttpEngine` posts SGLang's JSON body to a running server's
  ``POST /update_weights_from_tensor`` (stdlib ``http.client``, bounded timeout) and
  maps every failure to a policyworker error.
* ``policyworker.integrations.sglang.engine.InProcessSglangEngine`` takes the request object
  itself, in process, and rebuilds tensors from its typed buffer handles.

An engine declares ``wants_serialized``: True when it needs SGLang's pickled blobs
(a real server), False when the typed handles suffice (then no blob is ever built).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from typing import Any, Protocol, runtime_checkable

import msgspec

from policyworker.config import positive_seconds
from policyworker.errors import ConfigError, PeerLost, PolicyWorkerError, ProtocolError, RefitTimeout, TransportError
from policyworker.transports.sglang_ipc.format import BufferHandle

__all__ = [
    "EngineResult",
    "SglangEngine",
    "SglangHttpEngine",
    "UpdateWeightsFromTensorRequest",
]

_TRANSPORT = "sglang_ipc"


class UpdateWeightsFromTensorRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One bucket for one engine: SGLang's request fields plus our in-process extras.

    SGLang's fields (``UpdateWeightsFromTensorReqInput``): ``serialized_named_tensors``
    (one base64 ``MultiprocessingSerializer`` blob per tp rank; empty when the engine
    does not want blobs), ``load_format``, ``flush_cache``, ``abort_all_requests``,
    ``weight_version``, ``torch_empty_cache``. Ours, never sent over HTTP:
    ``buffers`` (tp rank i's buffer handle), ``metadata`` (the bucket's tensors; the
    same for every tp rank), ``bucket`` / ``num_buckets``.
    """

    serialized_named_tensors: list[str] = []
    load_format: str = "flattened_bucket"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    torch_empty_cache: bool = False
    buffers: tuple[BufferHandle, ...] = ()
    metadata: tuple[Any, ...] = ()  # sglang_format.FlattenedTensorMetadata, in process only
    bucket: int = 0
    num_buckets: int = 1

    def sglang_json(self) -> dict[str, Any]:
        """The HTTP body SGLang's route takes (its own fields only)."""
        body: dict[str, Any] = {
            "serialized_named_tensors": list(self.serialized_named_tensors),
            "load_format": self.load_format,
            "flush_cache": self.flush_cache,
            "abort_all_requests": self.abort_all_requests,
            "weight_version": self.weight_version,
        }
        if self.torch_empty_cache:
            # Newer servers only; older ones would not know the field, so send it only when asked.
            body["torch_empty_cache"] = True
        return body


class EngineResult(msgspec.Struct, frozen=True, kw_only=True):
    """SGLang's answer: ``success`` and ``message``.

    ``reading`` is ours, in process only (never over HTTP): an engine that shares the
    trainer's process and device may answer once its copies out of the bucket's buffer
    are *queued*, with a ``torch.cuda.Event`` recorded after them; the buffer may then be
    repacked by work ordered after that event on the device. None: the engine is done
    reading (SGLang's own answer, and every answer over HTTP).
    """

    success: bool
    message: str = ""
    reading: Any = None


@runtime_checkable
class SglangEngine(Protocol):
    """What the gather source calls once per bucket (blocking, on the refit thread).

    ``update_weights_from_tensor`` must return within ``timeout_s`` or raise
    ``RefitTimeout``; it returns ``EngineResult(success=False, ...)`` when the engine
    refused the bucket and raises a policyworker error when it could not be reached.
    """

    wants_serialized: bool

    def update_weights_from_tensor(
        self, request: UpdateWeightsFromTensorRequest, *, timeout_s: float
    ) -> EngineResult: ...


class SglangHttpEngine:
    """A running SGLang server, reached over HTTP.

    ``url``: ``http://host:port`` of the server. ``timeout_s`` bounds every request
    (connect, send and the wait for the answer). ``api_key`` goes out as a bearer
    token (SGLang's ``--api-key`` / admin key).

    Answers map to errors: 200 + ``success`` → ok; 400 or ``success: false`` →
    ``EngineResult(success=False)`` (the engine refused the bucket: the transport
    raises ``TransportError`` on every trainer rank); 401/403/404 → ``ConfigError``
    (wrong key or not an SGLang server); other statuses → ``TransportError``; a
    timeout → ``RefitTimeout``; refused / reset connections → ``PeerLost``; a body
    that is not SGLang's JSON → ``ProtocolError``.
    """

    wants_serialized = True
    path = "/update_weights_from_tensor"

    def __init__(self, url: str, *, timeout_s: float = 300.0, api_key: str | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"url must be http(s)://host:port, got {url!r}")
        positive_seconds(timeout_s, "timeout_s", optional=False)
        self.url = url.rstrip("/")
        self._scheme, self._host = parts.scheme, parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._prefix = parts.path.rstrip("/")
        self.timeout_s = float(timeout_s)
        self._api_key = api_key

    def __repr__(self) -> str:
        return f"SglangHttpEngine({self.url!r})"

    def update_weights_from_tensor(
        self, request: UpdateWeightsFromTensorRequest, *, timeout_s: float | None = None
    ) -> EngineResult:
        timeout = self.timeout_s if timeout_s is None else min(self.timeout_s, timeout_s)
        if timeout <= 0:
            raise RefitTimeout(f"no time left to call {self.url}{self.path}", transport=_TRANSPORT)
        body = json.dumps(request.sglang_json()).encode()
        status, payload = self._post(self.path, body, timeout)
        return self._result(status, payload)

    def _post(self, path: str, body: bytes, timeout: float) -> tuple[int, bytes]:
        conn_cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        # One deadline for the whole exchange: the socket timeout bounds each read,
        # the loop below bounds their sum.
        deadline = time.monotonic() + timeout
        conn = conn_cls(self._host, self._port, timeout=timeout)
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        where = f"{self.url}{path}"
        try:
            conn.request("POST", self._prefix + path, body=body, headers=headers)
            response = conn.getresponse()
            chunks = []
            while True:
                if time.monotonic() > deadline:
                    raise RefitTimeout(f"{where} did not answer within {timeout:.1f}s", transport=_TRANSPORT)
                chunk = response.read1(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
            return response.status, b"".join(chunks)
        except PolicyWorkerError:
            raise
        except (socket.timeout, TimeoutError) as exc:
            raise RefitTimeout(f"{where} did not answer within {timeout:.1f}s", transport=_TRANSPORT) from exc
        except (ConnectionError, http.client.RemoteDisconnected) as exc:
            raise PeerLost(f"lost the SGLang server at {where}: {exc}", transport=_TRANSPORT) from exc
        except http.client.HTTPException as exc:
            raise ProtocolError(f"bad HTTP exchange with {where}: {exc!r}", transport=_TRANSPORT) from exc
        except OSError as exc:  # unreachable host, DNS failure: the peer is not there
            raise PeerLost(f"cannot reach the SGLang server at {where}: {exc}", transport=_TRANSPORT) from exc
        finally:
            conn.close()

    def _result(self, status: int, payload: bytes) -> EngineResult:
        where = f"{self.url}{self.path}"
        if status in (401, 403):
            raise ConfigError(f"{where} refused our credentials (HTTP {status})")
        if status == 404:
            raise ConfigError(f"{where} does not exist (HTTP 404): is this an SGLang server?")
        if status not in (200, 400):
            raise TransportError(f"{where} answered HTTP {status}: {payload[:200]!r}", transport=_TRANSPORT)
        try:
            answer = msgspec.json.decode(payload, type=EngineResult)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"{where} answered HTTP {status} with a body that is not SGLang's "
                                f"{{success, message}}: {payload[:200]!r}", transport=_TRANSPORT) from exc
        if status == 400 and answer.success:
            raise ProtocolError(f"{where} answered HTTP 400 with success=true", transport=_TRANSPORT)
        return answer
