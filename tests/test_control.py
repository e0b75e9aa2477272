"""The TCP control endpoint: only holders of the group's token may steer a worker."""

from __future__ import annotations

import pytest
import zmq

from policyworker.runtime.control import ControlClient
from policyworker.errors import AccessDenied, ConfigError, RefitTimeout
from policyworker.runtime.procs import free_port
from policyworker.runtime.watchdog import process_watchdog

from .helpers import BareWorker

pytestmark = pytest.mark.anyio


async def test_endpoint_needs_a_group_token():
    w = BareWorker(device="cpu")
    with pytest.raises(ConfigError, match="init_collective"):
        w.start_control_endpoint()
    await w.shutdown()


async def test_token_holders_are_served_and_others_rejected_without_harm():
    w = BareWorker(device="cpu", timeout_s=10)
    await w.init_collective("127.0.0.1", free_port(), 1, train_world_size=1)
    first_token = w.control_token
    assert first_token and len(first_token) == 32
    address = w.start_control_endpoint()
    assert w.start_control_endpoint() == address  # idempotent
    client = ControlClient(address, w.control_token, timeout_s=5)
    status = client.status()
    assert (status.alive, status.role, status.rank) == (True, "trainer", 0)

    deadline = process_watchdog().arm(60, [], label="control-test", owner=w)
    assert client.stand_down() >= 1 and deadline.stood_down

    with pytest.raises(AccessDenied, match="bad token"):
        ControlClient(address, "0" * 32, timeout_s=5).status()
    # raw garbage: answered with Rejected, the server survives
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(address)
    sock.send(b"\x93\x01\x02\x03 not a request")
    assert b"Rejected" in sock.recv()
    sock.close(0)
    assert w._control.rejected == 2
    assert client.status().alive  # still serving

    # a new group, a new token: the old one stops working
    await w.init_collective("127.0.0.1", free_port(), 1, train_world_size=1)
    assert w.control_token != first_token
    with pytest.raises(AccessDenied):
        client.status()
    assert ControlClient(address, w.control_token).status().alive
    await w.shutdown()
    with pytest.raises(RefitTimeout):
        ControlClient(address, w.control_token, timeout_s=0.3).status()  # closed: bounded, no hang
