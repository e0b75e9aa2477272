"""A bounded, abortable request channel over one ZMQ DEALER socket.

Every receive polls in short slices so that the refit watchdog (another thread)
can cut it short through :meth:`Channel.abort`, and gives up at its deadline;
every send is bounded by the socket's SNDTIMEO. zmq errors never escape: ``Again``
becomes ``RefitTimeout``, a closed context ``TransportError``. The socket is used
from one thread only (the worker's refit executor): zmq sockets are not thread-safe.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from ..errors import ProtocolError, RefitAborted, RefitTimeout, TransportError
from . import zmq_wire as w

__all__ = ["Channel", "open_socket"]


def open_socket(endpoint: str, *, bind: bool, timeout_s: float) -> tuple[zmq.Context, zmq.Socket]:
    """A DEALER socket on ``endpoint`` with SNDTIMEO/RCVTIMEO = ``timeout_s`` and linger 0."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    ms = max(1, int(timeout_s * 1000))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, ms)
    sock.setsockopt(zmq.RCVTIMEO, ms)
    try:
        (sock.bind if bind else sock.connect)(endpoint)
    except zmq.ZMQError as exc:
        sock.close(0)
        ctx.term()
        raise TransportError(f"cannot open ZMQ endpoint {endpoint}: {exc}", transport="zmq") from exc
    return ctx, sock


class Channel:
    """Typed send/receive of :mod:`.zmq_wire` messages with deadlines.

    ``deadline`` arguments are ``time.monotonic()`` values. ``deadline_obj`` (a
    watchdog ``Deadline``, optional) tells a timeout from a stand-down abort.
    """

    def __init__(self, sock: zmq.Socket, *, rank: int | None = None, poll_s: float = 0.05) -> None:
        self.sock = sock
        self.rank = rank
        self.poll_ms = max(1, int(poll_s * 1000))
        self.aborted = threading.Event()
        self.deadline_obj: Any = None

    def abort(self) -> None:
        """Make the current (and next) wait raise ``RefitAborted``; safe from any thread."""
        self.aborted.set()

    def _check_abort(self, what: str) -> None:
        if self.aborted.is_set():
            if self.deadline_obj is not None and self.deadline_obj.fired:
                raise RefitTimeout(f"{what}: the refit deadline passed", rank=self.rank, transport="zmq")
            raise RefitAborted(f"{what}: the refit was aborted", rank=self.rank, transport="zmq")

    def send(self, msg: w.Message, what: str = "send") -> None:
        self._check_abort(what)
        try:
            self.sock.send(w.encode(msg), copy=False)
        except zmq.Again as exc:
            raise RefitTimeout(f"{what}: the peer did not take the message in time", rank=self.rank,
                               transport="zmq") from exc
        except zmq.ZMQError as exc:
            raise TransportError(f"{what}: {exc}", rank=self.rank, transport="zmq") from exc

    def recv(self, deadline: float, what: str) -> w.ZmqMessage:
        """The next message; RefitTimeout at ``deadline``, RefitAborted on abort."""
        while True:
            self._check_abort(what)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RefitTimeout(f"{what}: nothing arrived before the deadline", rank=self.rank, transport="zmq")
            try:
                ready = self.sock.poll(min(self.poll_ms, max(1, int(remaining * 1000))), zmq.POLLIN)
                if not ready:
                    continue
                frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                raise TransportError(f"{what}: {exc}", rank=self.rank, transport="zmq") from exc
            return w.decoder.decode(frame.buffer)

    def expect(self, deadline: float, what: str, *types: type) -> w.ZmqMessage:
        msg = self.recv(deadline, what)
        if not isinstance(msg, types):
            raise ProtocolError(f"{what}: got {type(msg).__name__}, expected "
                                f"{' or '.join(t.__name__ for t in types)}", rank=self.rank, transport="zmq")
        return msg
