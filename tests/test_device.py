import json
import os
import re
import socket

import pytest
import torch

from policyworker.runtime import device


def test_cpu_facts_are_stable_and_documented():
    a = device.device_facts("cpu", cpu_index=3)
    b = device.device_facts("cpu", cpu_index=3)
    assert a == b
    assert a.kind == "cpu" and a.index == 3
    assert a.device_id == f"CPU-{socket.gethostname()}-3"
    assert a.torch_device == torch.device("cpu")


def test_free_memory_and_peak_on_cpu():
    free = device.free_memory_bytes("cpu")
    assert free > 0
    device.reset_peak_memory("cpu")
    before = device.peak_memory_bytes("cpu")
    x = torch.ones(64 * 2**20, dtype=torch.uint8)  # touch 64 MiB
    x.add_(1)
    after = device.peak_memory_bytes("cpu")
    assert after >= before + 32 * 2**20
    del x
    device.reset_peak_memory("cpu")
    assert device.peak_memory_bytes("cpu") < after


def test_nvml_missing_means_cpu_answers(monkeypatch):
    """No GPU library must never crash: NVML init errors select the CPU path."""
    import types

    fake = types.ModuleType("pynvml")

    class NVMLError_LibraryNotFound(Exception):
        pass

    def init():
        raise NVMLError_LibraryNotFound("libnvidia-ml.so.1 not found")

    fake.nvmlInit = init
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    monkeypatch.setattr(device, "_nvml_state", {})
    assert device._nvml() is None
    assert device.free_memory_bytes("cpu") > 0


def test_node_ip_override(monkeypatch):
    device.node_ip.cache_clear()
    monkeypatch.setenv("POLICYWORKER_NODE_IP", "10.1.2.3")
    try:
        assert device.node_ip() == "10.1.2.3"
    finally:
        device.node_ip.cache_clear()
    assert re.match(r"^\d+\.\d+\.\d+\.\d+$", device.node_ip())


def test_cpu_profile_writes_a_chrome_trace(tmp_path):
    facts = device.device_facts("cpu")
    handle = device.start_profile(facts)
    torch.mm(torch.randn(64, 64), torch.randn(64, 64))
    path = device.stop_profile(handle, str(tmp_path / "trace.json"))
    assert path and os.path.exists(path)
    with open(path) as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU import path")
def test_import_without_gpu_works_in_a_fresh_interpreter():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import policyworker, policyworker.runtime.device as d; print(d.device_facts().device_id)"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("CPU-")
