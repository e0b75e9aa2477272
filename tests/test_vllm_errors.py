"""The typed-error marker across vLLM's text-only boundary, and the tp ranks' agreement
(without vLLM: a real TCPStore and one thread per rank)."""

from __future__ import annotations

import base64
import datetime
import json
import threading
import time

import pytest
import torch.distributed as dist

from policyworker.runtime.procs import free_port
from policyworker.errors import (CheckpointError, ConfigError, PeerLost, PolicyWorkerError, ProcessFailed,
                                 RefitTimeout, TransportError)
from policyworker.integrations.vllm.errors import engine_error, error_from_text, mark, typed_errors
from policyworker.integrations.vllm.rpc import Agreement


def _as_vllm_raises(err: BaseException) -> Exception:
    # What LLM raises for a failed worker (tp >= 2): the worker's str() inside two wrappers.
    return Exception(f"Call to collective_rpc method failed: Worker failed with error '{err}', please check "
                     f"the stack trace above for the root cause")


@pytest.mark.parametrize("err", [
    RefitTimeout("refit 'x' passed its deadline", rank=3, transport="nccl_reshard"),
    PeerLost("gloo: Connection closed by peer [127.0.0.1]:1234 'quoted'", rank=1, param="lm_head.weight"),
    ConfigError("update_info.version 1 is not newer than the version vLLM rank 0 serves (1)", rank=0),
    ProcessFailed("trainer 1 died", failures={1: "exit code -9"}),
    CheckpointError("cannot write", path="/tmp/x", rank=2),
])
def test_a_marked_error_comes_back_as_its_class_with_message_and_attributes(err):
    message, attrs = str(err), dict(vars(err))
    wrapped = _as_vllm_raises(mark(err))
    for text in (str(wrapped), repr(str(wrapped)), json.dumps({"error": {"message": str(wrapped)}})):
        back = error_from_text(text)
        assert type(back) is type(err) and str(back) == message
        for key, value in attrs.items():
            expect = {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
            assert getattr(back, key) == expect, key
    with pytest.raises(type(err)) as info:
        with typed_errors():
            raise wrapped
    assert info.value.__cause__ is wrapped and str(info.value) == message


def test_text_without_a_marker_is_never_guessed_from():
    plain = Exception("Worker failed with error 'RefitTimeout: refit passed its deadline'")
    assert engine_error(plain) is None
    with pytest.raises(Exception) as info:
        with typed_errors():
            raise plain
    assert info.value is plain
    # A marker naming a class that is not ours rebuilds the root class, never another type.
    payload = base64.urlsafe_b64encode(json.dumps({"type": "SystemExit", "message": "x"}).encode()).decode()
    forged = error_from_text(f"[policyworker-error:{payload}]")
    assert type(forged) is PolicyWorkerError and str(forged) == "x"
    assert error_from_text("[policyworker-error:not base64 json!]") is None
    # Marking twice keeps one marker; our own error passes through typed_errors as itself.
    err = mark(mark(ConfigError("bad", rank=0)))
    assert str(err).count("[policyworker-error:") == 1
    with pytest.raises(ConfigError) as info:
        with typed_errors():
            raise err
    assert str(info.value) == "bad"


def _agree(n: int, errors: dict[int, BaseException], timeout_s: float = 10.0, absent: tuple = ()):
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, n, True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    out: dict[int, object] = {}

    def rank(r: int) -> None:
        store = master if r == 0 else dist.TCPStore("127.0.0.1", port, n, False,
                                                    timeout=datetime.timedelta(seconds=10))
        agreement = Agreement(dist.PrefixStore("t", store), tp_rank=r, tp_size=n, prefix="dp0")
        try:
            for call in range(3):  # three calls in a row: each is agreed on by itself
                out[(r, call)] = agreement.outcome("call", errors.get(r) if call == 1 else None, timeout_s)
        except PolicyWorkerError as exc:
            out[(r, "raised")] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n) if r not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.timeout(60)
def test_every_rank_agrees_on_one_error_and_the_next_call_answers_for_itself():
    out = _agree(3, {0: ValueError("a bug on rank 0"), 2: PeerLost("trainer gone", rank=2)})
    for r in range(3):
        assert out[(r, 0)] is None and out[(r, 2)] is None
        agreed = out[(r, 1)]
        # The lowest rank with one of ours speaks for the engine (not rank 0's bug).
        assert isinstance(agreed, PeerLost) and agreed.rank == 2 and "trainer gone" in str(agreed)
    only_bugs = _agree(2, {1: KeyError("k")})
    assert all(type(only_bugs[(r, 1)]) is PolicyWorkerError and "KeyError" in str(only_bugs[(r, 1)])
               for r in range(2))


@pytest.mark.timeout(60)
def test_a_rank_that_never_answers_is_a_bounded_typed_error():
    t0 = time.monotonic()
    out = _agree(2, {}, timeout_s=1.0, absent=(1,))
    assert isinstance(out[(0, "raised")], RefitTimeout) and isinstance(out[(0, "raised")], TransportError)
    assert time.monotonic() - t0 < 10.0


def test_the_marker_survives_vllm_servers_error_body():
    pytest.importorskip("vllm")
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    # The message holds what sanitizing rewrites (a path, an address); the marker is kept.
    err = PeerLost("store at /tmp/x/y.sock <obj at 0xdeadbeef> lost", rank=5, transport="nccl_reshard")
    body = create_error_response(_as_vllm_raises(mark(err))).model_dump_json()
    back = error_from_text(body)
    assert type(back) is PeerLost and (back.rank, back.transport) == (5, "nccl_reshard")
    assert str(back) == "store at /tmp/x/y.sock <obj at 0xdeadbeef> lost"
