"""A bounded, abortable request channel over one ZMQ DEALER socket.

Every receive polls in short slices so that the refit watchdog (another thread)
can cut it short through :meth:`Channel.abort`, and gives up at its deadline;
every send is bounded by the socket's SNDTIMEO. zmq errors never escape: ``Again``
becomes ``RefitTimeout``, a closed context ``TransportError``. The socket is used
from one thread only (the worker's refit executor): zmq sockets are not thread-safe.

Recovery without a rebuild:

* Aborts are per refit: :meth:`Channel.begin` installs the refit's own abort event
  (made when the refit was *called*, before it reached the executor), so an abort
  between the call and the executor is kept, and a late abort of a finished refit
  never poisons the next one (nothing is ever cleared).
* Attempts fence stale messages: a message whose ``attempt`` is not the current one
  is dropped (counted in ``stale``); a Ready or Hello arriving while the trainer is
  mid-refit means the rollout started over: it is kept for the next refit and this
  one fails (``TransportError``).
* A peer that goes away mid-wait (its process died: the kernel closes the IPC
  connection) raises ``PeerLost`` at once, from the socket monitor's DISCONNECTED
  event; disconnects seen before a refit began are not this refit's.
* Connect waits (Hello, Welcome) ride through a reconnect: on a re-attach the new socket
  can connect to the old peer socket on the same path just before that one closes. A
  disconnect there is only ``PeerLost`` when no connection comes back (zmq reconnects to
  the new socket) and nothing arrives within ``reconnect_grace_s``; the rollout sends its
  Hello again on the new connection (the first went down with the old one).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from policyworker.errors import ConfigError, PeerLost, ProtocolError, RefitAborted, RefitTimeout, TransportError
from policyworker.transports.zmq import wire as w

__all__ = ["IPC_PATH_MAX", "RECONNECT_GRACE_S", "Channel", "check_endpoint", "open_socket"]

#: Longest ``ipc://`` path the platform takes: ``sockaddr_un.sun_path`` less its NUL
#: (108 - 1 on Linux, 104 - 1 on macOS/BSD).
IPC_PATH_MAX = 103 if sys.platform == "darwin" or "bsd" in sys.platform else 107

#: How long a connect wait rides through a disconnect (zmq reconnects every 100 ms).
RECONNECT_GRACE_S = 1.0


def check_endpoint(endpoint: str) -> None:
    """``ConfigError`` for an ``ipc://`` path longer than the platform's socket path limit
    (zmq would fail on it, or on some versions bind a truncated path the peer never finds)."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        n = len(os.fsencode(path))
        if n > IPC_PATH_MAX:
            raise ConfigError(f"IPC socket path is {n} bytes, the platform limit is {IPC_PATH_MAX}: {path!r}; "
                              f"use a shorter runtime_dir (or POLICYWORKER_RUNTIME_DIR)", transport="zmq")


def open_socket(endpoint: str, *, bind: bool, timeout_s: float) -> tuple[zmq.Context, zmq.Socket]:
    """A DEALER socket on ``endpoint`` with SNDTIMEO/RCVTIMEO = ``timeout_s`` and linger 0.

    ``ConfigError`` for an IPC path over the platform limit (:func:`check_endpoint`)."""
    check_endpoint(endpoint)
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


class StartedOver(TransportError):
    """The colocated rollout opened a new attempt or session mid-refit (its message is
    kept for the next wait): the trainer may follow it within the same refit."""


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
        #: Bounds each wait once the refit's deadline was stood down (the transport's timeout_s).
        self.fallback_s: float | None = None
        #: The current refit attempt (None: none open; only a Ready may open one).
        self.attempt: str | None = None
        self.stale = 0
        self._stash: list[Any] = []
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED
                                                | zmq.EVENT_ACCEPTED)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def begin(self, aborted: threading.Event, deadline_obj: Any, attempt: str | None,
              fallback_s: float | None = None) -> None:
        """A refit (or connect) starts: its own abort event, deadline and attempt token.

        ``fallback_s``: once ``deadline_obj`` is stood down, a wait ends this long after it
        started (the controller disarmed the deadline; the transport's own bound stays).
        """
        self.aborted, self.deadline_obj, self.attempt = aborted, deadline_obj, attempt
        self.fallback_s = fallback_s
        while self._monitor.poll(0):  # a disconnect before this refit is not this refit's
            self._monitor.recv_multipart(zmq.NOBLOCK)

    def abort(self) -> None:
        """Make the current wait raise ``RefitAborted``; safe from any thread."""
        self.aborted.set()

    def close(self) -> None:
        """Close the monitor (before the socket's context terminates). Idempotent."""
        if not self._monitor.closed:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass  # the socket is closed already: its monitor stopped with it
            self._monitor.close(0)

    def _check_abort(self, what: str) -> None:
        if self.aborted.is_set():
            if self.deadline_obj is not None and self.deadline_obj.fired:
                raise RefitTimeout(f"{what}: the refit deadline passed", rank=self.rank, transport="zmq")
            raise RefitAborted(f"{what}: the refit was aborted", rank=self.rank, transport="zmq")

    def send(self, msg: w.Message, what: str = "send") -> None:
        self._check_abort(what)
        if self.attempt and getattr(msg, "attempt", None) == "":
            msg = msgspec.structs.replace(msg, attempt=self.attempt)
        try:
            self.sock.send(w.encode(msg), copy=False)
        except zmq.Again as exc:
            raise RefitTimeout(f"{what}: the peer did not take the message in time", rank=self.rank,
                               transport="zmq") from exc
        except zmq.ZMQError as exc:
            raise TransportError(f"{what}: {exc}", rank=self.rank, transport="zmq") from exc

    def _monitor_event(self) -> int:
        return parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]

    def recv(self, deadline: float, what: str, *, reconnect_grace_s: float | None = None,
             on_reconnect: Any = None) -> w.ZmqMessage:
        """The next message; RefitTimeout at ``deadline`` (or ``fallback_s`` into the wait once
        the deadline was stood down), RefitAborted on abort.

        ``reconnect_grace_s``: a disconnect is ``PeerLost`` only when, this long after it, no
        connection came back and nothing arrived (None: at once). ``on_reconnect()`` runs when
        one comes back (the rollout re-sends its Hello)."""
        started = time.monotonic()
        lost_at: float | None = None
        while True:
            self._check_abort(what)
            bound = deadline
            if self.fallback_s is not None and getattr(self.deadline_obj, "stood_down", False):
                bound = min(deadline, started + self.fallback_s)
            remaining = bound - time.monotonic()
            if remaining <= 0:
                raise RefitTimeout(f"{what}: nothing arrived before the deadline", rank=self.rank, transport="zmq")
            try:
                ready = dict(self._poller.poll(min(self.poll_ms, max(1, int(remaining * 1000)))))
                if self.sock in ready:
                    # What the peer sent before it went away is read first (e.g. a Commit
                    # sent right before its process closed the socket): data beats a disconnect.
                    try:
                        frame = self.sock.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        frame = None
                    if frame is not None:
                        return w.decoder.decode(frame.buffer)
                if self._monitor in ready:
                    event = self._monitor_event()
                    if event & zmq.EVENT_DISCONNECTED:
                        if reconnect_grace_s is None:
                            raise PeerLost(f"{what}: the colocated peer closed its connection (process gone?)",
                                           rank=self.rank, transport="zmq")
                        lost_at = time.monotonic()
                    elif lost_at is not None:
                        lost_at = None  # a connection came back (zmq reconnected, or the peer's new socket)
                        if on_reconnect is not None:
                            on_reconnect()
                if lost_at is not None and time.monotonic() - lost_at > reconnect_grace_s:
                    raise PeerLost(f"{what}: the colocated peer closed its connection and none came back "
                                   f"within {reconnect_grace_s:g} s (process gone?)", rank=self.rank, transport="zmq")
                continue
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                raise TransportError(f"{what}: {exc}", rank=self.rank, transport="zmq") from exc

    def expect(self, deadline: float, what: str, *types: type, **recv_kw: Any) -> w.ZmqMessage:
        """The next message of ``types`` in the current attempt; stale ones are dropped.
        ``recv_kw``: :meth:`recv`'s reconnect options.

        A Ready opens an attempt (its token becomes current). An unexpected Ready or
        Hello is kept for the next wait that expects it, and this one raises
        ``TransportError`` (the rollout started over).
        """
        while True:
            msg = self._stash.pop(0) if self._stash else self.recv(deadline, what, **recv_kw)
            if isinstance(msg, w.Ready) and w.Hello in types and w.Ready not in types:
                self.stale += 1  # waiting for a (new) session's Hello: an old session's Ready
                continue
            if isinstance(msg, (w.Ready, w.Hello)):
                if isinstance(msg, types):
                    if isinstance(msg, w.Ready):
                        self.attempt = msg.attempt or None
                    return msg
                self._stash.append(msg)
                raise StartedOver(f"{what}: the rollout started over ({type(msg).__name__} mid-refit)",
                                  rank=self.rank, transport="zmq")
            token = getattr(msg, "attempt", None)
            if token is not None and token != (self.attempt or ""):
                self.stale += 1  # a message of an older attempt (it failed): not ours
                continue
            if isinstance(msg, w.Welcome) and not isinstance(msg, types):
                self.stale += 1  # an older session's Welcome
                continue
            if not isinstance(msg, types):
                raise ProtocolError(f"{what}: got {type(msg).__name__}, expected "
                                    f"{' or '.join(t.__name__ for t in types)}", rank=self.rank, transport="zmq")
            return msg
