"""How the vLLM backend's background threads make way for the engine's thread on a CPU
engine (:func:`give_way`, :func:`hurry_gil`), in a fresh process whose main thread is
pinned to one core as vLLM pins its worker's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

_CHILD = r"""
import json, os, sys, threading
from policyworker.integrations.vllm.overlap import BACKGROUND_NICE, GIL_SWITCH_S, give_way, hurry_gil

os.sched_setaffinity(0, {0})  # the main thread: the engine's, pinned as vLLM pins it
seen = {"start_nice": os.getpriority(os.PRIO_PROCESS, threading.get_native_id())}

def background():
    give_way()
    tid = threading.get_native_id()
    seen["cores"] = sorted(os.sched_getaffinity(0))
    seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
    child = threading.Thread(target=lambda: seen.update(child_cores=sorted(os.sched_getaffinity(0)),
                                                      child_nice=os.getpriority(os.PRIO_PROCESS,
                                                                                threading.get_native_id())))
    child.start(); child.join()

t = threading.Thread(target=background); t.start(); t.join()
seen["main_cores"] = sorted(os.sched_getaffinity(0))
seen["main_nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
before = sys.getswitchinterval()
seen["returned"] = hurry_gil()
seen["before"], seen["after"] = before, sys.getswitchinterval()
hurry_gil(1.0)  # never lengthens it
seen["after_long"] = sys.getswitchinterval()
seen["expect_nice"], seen["switch_s"] = BACKGROUND_NICE, GIL_SWITCH_S
print(json.dumps(seen))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux sets affinity per thread")
def test_background_threads_leave_the_engines_core_and_priority_and_hurry_the_gil():
    cores = set(range(os.cpu_count() or 1))
    if 0 not in os.sched_getaffinity(0):
        pytest.fail("this host does not let the test pin a thread to core 0")
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=50, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    others = sorted(cores - {0}) or sorted(cores)  # a one-core host: nowhere else to go
    assert seen["cores"] == others and seen["child_cores"] == others  # and its threads inherit it
    assert seen["nice"] == max(seen["expect_nice"], seen["start_nice"]) and seen["child_nice"] == seen["nice"]
    assert seen["main_cores"] == [0] and seen["main_nice"] == seen["start_nice"]  # the engine's thread keeps its own
    assert seen["returned"] == seen["before"] and seen["after"] == min(seen["before"], seen["switch_s"])
    assert seen["after_long"] == seen["after"]
