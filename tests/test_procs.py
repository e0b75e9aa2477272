"""How a world's processes start (runtime.procs): forked from a server that imported torch
once, yet each with the parent's environment and stdout/stderr as they are at its start,
as a spawned process would have; spawn on request; a bad start method refused."""

from __future__ import annotations

import os
import sys

import pytest

from policyworker.errors import ConfigError
from policyworker.runtime.procs import run_world, start_process

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _report(rank: int) -> dict:
    import torch

    return {"probe": os.environ.get("PW_TEST_PROBE"), "gone": os.environ.get("PW_TEST_GONE"),
            "override": os.environ.get("PW_TEST_OVERRIDE"), "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"), "ppid": os.getppid(), "pid": os.getpid()}


def test_a_forked_process_has_the_parents_environment_as_at_its_start(monkeypatch):
    monkeypatch.setenv("PW_TEST_GONE", "set when the server may have started")
    first = run_world(_report, 1, timeout_s=60)[0]  # starts the fork server if no test did
    assert first["gone"] == "set when the server may have started"
    assert first["ppid"] != os.getpid()  # the fork server's child, not this process's
    monkeypatch.delenv("PW_TEST_GONE")
    monkeypatch.setenv("PW_TEST_PROBE", "set after")
    monkeypatch.setenv("PW_TEST_OVERRIDE", "parent's")
    out = run_world(_report, 2, env={"PW_TEST_OVERRIDE": "world's", "OMP_NUM_THREADS": "2"}, timeout_s=60)
    for r in out:
        assert (r["probe"], r["gone"], r["override"]) == ("set after", None, "world's")
        assert r["omp"] == "2" and r["threads"] == 2  # the world's own setting reaches torch
        assert r["ppid"] == first["ppid"]  # one server for every world of this process
    assert len({r["pid"] for r in out}) == 2 and os.getpid() not in {r["pid"] for r in out}
    assert run_world(_report, 1, timeout_s=60)[0]["threads"] == 1  # the default: one thread


def _speak(rank: int, text: str) -> None:
    print(f"out {text} {rank}", flush=True)
    print(f"err {text} {rank}", file=sys.stderr, flush=True)


def test_world_output_goes_where_the_parents_goes_now(capfd):
    run_world(_speak, 1, ("first",), timeout_s=60)
    out, err = capfd.readouterr()
    assert "out first 0" in out and "err first 0" in err
    run_world(_speak, 2, ("second",), timeout_s=60)
    out, err = capfd.readouterr()
    assert {"out second 0", "out second 1"} <= set(out.splitlines())
    assert {"err second 0", "err second 1"} <= set(err.splitlines())


def _exit_with(code: int) -> None:
    print(f"one process {code}", flush=True)
    sys.exit(code)


def test_one_process_runs_in_the_environment_given_and_its_exit_code_is_read(monkeypatch, capfd):
    monkeypatch.setenv("PW_TEST_PROBE", "one")
    p = start_process(_exit_with, (3,), env={"PW_TEST_OVERRIDE": "x"})
    p.join(60)
    assert p.exitcode == 3
    assert "one process 3" in capfd.readouterr().out


def test_spawn_on_request_and_a_bad_method_is_refused(monkeypatch):
    monkeypatch.setenv("POLICYWORKER_START_METHOD", "spawn")
    monkeypatch.setenv("PW_TEST_PROBE", "spawned")
    r = run_world(_report, 1, timeout_s=90)[0]
    assert r["ppid"] == os.getpid() and r["probe"] == "spawned" and r["threads"] == 1
    monkeypatch.setenv("POLICYWORKER_START_METHOD", "fork")
    with pytest.raises(ConfigError, match="POLICYWORKER_START_METHOD"):
        run_world(_report, 1, timeout_s=10)
