"""The zmq channel's connect waits across a re-attach: real sockets on a real ipc path.

On a re-attach both sides close their socket and open a new one on the same path. The
rollout's new socket can connect to the trainer's previous socket just before that one
closes: its Hello goes down with that connection. These tests make that order happen
for sure (not by chance) and check what each side sees.
"""

from __future__ import annotations

import threading
import time

import pytest

from policyworker.errors import PeerLost
from policyworker.transports.zmq import wire as w
from policyworker.transports.zmq.channel import RECONNECT_GRACE_S, Channel, open_socket

HELLO = w.Hello(rank=0, plan_hash="h" * 8, session="s1", device_id="", pid=1)


def _channel(endpoint: str, *, bind: bool):
    ctx, sock = open_socket(endpoint, bind=bind, timeout_s=5.0)
    chan = Channel(sock, rank=0)
    chan.begin(threading.Event(), None, None)
    return ctx, sock, chan


def _close(ctx, sock, chan) -> None:
    chan.close()
    sock.close(0)
    ctx.term()


def _hello_reaches(sock) -> None:
    assert sock.poll(5000), "the first Hello never reached the old trainer socket"
    assert isinstance(w.decoder.decode(sock.recv()), w.Hello)


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 -- handed to the test thread
            out["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


@pytest.mark.timeout(30)
def test_the_rollout_sends_its_hello_again_when_the_old_trainer_socket_closes_under_it(tmp_path):
    ep = f"ipc://{tmp_path}/t.sock"
    old = open_socket(ep, bind=True, timeout_s=5.0)
    r_ctx, r_sock, rollout = _channel(ep, bind=False)
    rollout.send(HELLO, "Hello")
    _hello_reaches(old[1])  # it went down the old connection, and dies with it
    old[1].close(0)
    old[0].term()
    new = _channel(ep, bind=True)
    try:
        th, out = _in_thread(lambda: rollout.expect(time.monotonic() + 10, "waiting for the Welcome", w.Welcome,
                                                    reconnect_grace_s=RECONNECT_GRACE_S,
                                                    on_reconnect=lambda: rollout.send(HELLO, "Hello")))
        hello = new[2].expect(time.monotonic() + 10, "waiting for the Hello", w.Hello,
                              reconnect_grace_s=RECONNECT_GRACE_S)
        assert hello == HELLO
        new[2].send(w.Welcome(plan_hash=hello.plan_hash, session=hello.session, ok=True, reason=""), "Welcome")
        th.join(10)
        assert "error" not in out, out
        assert out["value"].session == "s1"
    finally:
        _close(*new)
        _close(r_ctx, r_sock, rollout)


@pytest.mark.timeout(30)
def test_a_trainer_that_is_really_gone_is_still_peer_lost_within_the_grace(tmp_path):
    ep = f"ipc://{tmp_path}/t.sock"
    old = open_socket(ep, bind=True, timeout_s=5.0)
    r = _channel(ep, bind=False)
    try:
        r[2].send(HELLO, "Hello")
        _hello_reaches(old[1])
        old[1].close(0)
        old[0].term()
        t0 = time.monotonic()
        with pytest.raises(PeerLost, match="none came back"):
            r[2].expect(t0 + 20, "waiting for the Welcome", w.Welcome, reconnect_grace_s=RECONNECT_GRACE_S)
        assert time.monotonic() - t0 < RECONNECT_GRACE_S + 2.0  # not the 20 s deadline
    finally:
        _close(*r)


@pytest.mark.timeout(30)
def test_the_trainer_waiting_for_a_hello_rides_through_the_old_rollout_socket_closing(tmp_path):
    ep = f"ipc://{tmp_path}/t.sock"
    trainer = _channel(ep, bind=True)
    old_rollout = open_socket(ep, bind=False, timeout_s=5.0)
    try:
        assert old_rollout[1].poll(5000, 2)  # POLLOUT: connected
        th, out = _in_thread(lambda: trainer[2].expect(time.monotonic() + 10, "waiting for the Hello", w.Hello,
                                                       reconnect_grace_s=RECONNECT_GRACE_S))
        time.sleep(0.2)
        old_rollout[1].close(0)  # the trainer's wait sees a disconnect...
        old_rollout[0].term()
        time.sleep(0.3)
        new_rollout = _channel(ep, bind=False)  # ...and the new socket's Hello within the grace
        try:
            new_rollout[2].send(HELLO, "Hello")
            th.join(10)
            assert "error" not in out, out
            assert out["value"] == HELLO
        finally:
            _close(*new_rollout)
    finally:
        _close(*trainer)
