"""``init_info.staging``'s choice from free memory and the live-storage scan behind
"device" staging (no engine: the real-engine cells are in vllm_failure_cases.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from policyworker.errors import ConfigError  # noqa: E402
from policyworker.integrations.vllm.live import live_storages, storage_key  # noqa: E402
from policyworker.integrations.vllm.staging import choose  # noqa: E402

GIB = 1 << 30
CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize("device, free_device, free_host, want", [
    (CPU, None, 3 * GIB, "device"),          # MemAvailable holds 3 sets
    (CPU, None, 3 * GIB - 1, "none"),
    (CUDA, 2 * GIB, 0, "device"),            # the set + 10% of the free memory to spare
    (CUDA, GIB + GIB // 20, 3 * GIB, "host"),
    (CUDA, GIB // 2, 2 * GIB, "none"),
])
def test_auto_chooses_from_free_memory_and_says_why(device, free_device, free_host, want):
    mode, reason = choose("auto", set_bytes=GIB, device=device, overlap=False, delta=False,
                          free_device=free_device, free_host=free_host)
    assert mode == want
    assert "GiB" in reason and ("MemAvailable" in reason or "device memory" in reason)
    assert choose(want, set_bytes=GIB, device=device, overlap=False, delta=False) == (want, f"init_info.staging={want!r}")


@pytest.mark.parametrize("overlap, delta", [(True, False), (False, True)])
def test_auto_never_picks_in_place_for_overlap_or_delta(overlap, delta):
    with pytest.raises(ConfigError, match="cannot hold a staging set"):
        choose("auto", set_bytes=GIB, device=CPU, overlap=overlap, delta=delta, free_host=GIB)
    with pytest.raises(ConfigError, match="staging='none'"):
        choose("none", set_bytes=GIB, device=CPU, overlap=overlap, delta=delta)
    with pytest.raises(ConfigError, match="must be one of"):
        choose("pinned", set_bytes=GIB, device=CPU, overlap=False, delta=False)


def test_live_storages_sees_parameters_attributes_and_kernel_closures():
    layer = torch.nn.Linear(4, 4)
    kept = torch.randn(4, 4)        # a kernel closing over the weight (vLLM's CPU lambdas do)
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, kept, bias)
    packed = torch.randn(8)
    layer.packed = [packed]         # a tensor attribute inside a container
    unseen = torch.randn(4, 4)
    live = live_storages([layer])
    for t in (layer.weight, layer.bias, kept, packed, kept[1:]):  # a view shares its storage
        assert storage_key(t) in live
    assert storage_key(unseen) not in live
