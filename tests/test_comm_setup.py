"""Group setup under threads, and a hung world that says where it hung (the MoE-test flake, issue 17)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from policyworker.runtime.procs import ProcessFailed, process_context, start_world
from policyworker.runtime.comm_setup import _quiet_cpp_stderr


def test_overlapping_quiet_stderr_from_two_threads_restores_the_real_stderr(capfd, monkeypatch):
    import sys

    stderr = os.fdopen(2, "w", closefd=False)  # a real fd-2 stderr, as in a worker process
    monkeypatch.setattr(sys, "stderr", stderr)
    real = os.fstat(2)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a():
        with _quiet_cpp_stderr():
            a_in.set()
            b_in.wait(10)
            os.write(2, b"from a\n")
        a_out.set()

    def b():
        a_in.wait(10)
        with _quiet_cpp_stderr():
            b_in.set()
            a_out.wait(10)  # a leaves first: the order that used to strand fd 2 on a's temp file
            os.write(2, b"from b\n[c10d] frame #0: noise\n")

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    now = os.fstat(2)
    assert (now.st_dev, now.st_ino) == (real.st_dev, real.st_ino)  # fd 2 is the real stderr again
    stderr.flush()
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "from a" in err and "from b" in err and "after" in err  # held back, then re-emitted
    assert "frame #0" not in err


def _hang(rank: int, ready) -> None:
    ready.set()
    time.sleep(120)


@pytest.mark.timeout(90)
def test_a_world_that_overruns_reports_its_stacks(capfd):

    ready = process_context().Event()
    world = start_world(_hang, 1, (ready,))
    assert ready.wait(60)
    time.sleep(0.5)  # from ready.set() into the sleep
    with pytest.raises(ProcessFailed, match="did not finish in time"):
        world.collect(0.5)
    err = capfd.readouterr().err
    assert "test_comm_setup.py" in err and "in _hang" in err  # faulthandler names the hung frame


def _one_fails_one_waits(rank: int, ready) -> None:
    if rank == 1:
        ready.wait(60)
        raise ValueError("rank 1 failed on purpose")
    ready.set()
    time.sleep(120)  # as a rank blocked on the one that died (a barrier, a collective) would


@pytest.mark.timeout(90)
def test_a_failed_rank_ends_the_wait_for_the_others_after_the_grace(monkeypatch):

    from policyworker.runtime import procs

    monkeypatch.setattr(procs, "FAIL_GRACE_S", 1.0)
    ready = process_context().Event()
    world = start_world(_one_fails_one_waits, 2, (ready,))
    t0 = time.monotonic()
    with pytest.raises(ProcessFailed) as info:
        world.collect(80)  # not the whole 80 s: the grace after rank 1's failure
    assert time.monotonic() - t0 < 30
    assert "failed on purpose" in info.value.failures[1]
    assert "after another rank failed" in info.value.failures[0]
