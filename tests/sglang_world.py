"""Process bodies for the sglang_ipc tests (real processes, gloo on CPU)."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from policyworker import PolicyWorkerError, RolloutWorker, TorchPolicyWorker
from policyworker.runtime.comm import new_group
from policyworker.models import get_preset, seeded_state_dict
from policyworker.models.toy_model import build_model
from policyworker.transports.sglang_ipc.client import EngineResult, SglangHttpEngine
from policyworker.integrations.sglang.engine import InProcessSglangEngine

# AbstractPolicyWorker carries SglangIpcMixin, so every trainer worker can refit SGLang.
SglangTrainer = TorchPolicyWorker


@dataclass
class SglangSpec:
    port: int = 0
    world: int = 2
    layouts: list[dict[str, Any]] = field(default_factory=lambda: [{"engine_gpu_counts": [2]}])
    refits: int = 2
    bucket_bytes: int = 64 << 10
    buffers: int = 2  # sglang_ipc pipeline buffers per rank
    engine: str = "inprocess"  # or "http"
    http_port: int = 0
    fail: dict[str, int] | None = None  # {"version": v, "bucket": k}: the engine refuses that bucket
    timeout_s: float = 30.0
    device: str = "cpu"  # every trainer rank and rollout on this device (e.g. "cuda:0")
    # The update group's backend when not init_collective's default (nccl with CUDA):
    # two trainer processes on one GPU need gloo, since NCCL refuses two ranks on one GPU.
    update_backend: str | None = None


class RefusingEngine(InProcessSglangEngine):
    """An in-process engine that refuses bucket ``fail["bucket"]`` of refit ``fail["version"]``."""

    def __init__(self, workers, *, fail: dict[str, int]) -> None:
        super().__init__(workers)
        self.fail = fail
        self.refit = 0

    def update_weights_from_tensor(self, request, *, timeout_s=None):
        if request.bucket == 0:
            self.refit += 1
        if self.refit == self.fail["version"] and request.bucket == self.fail["bucket"]:
            return EngineResult(success=False, message="injected refusal")
        return super().update_weights_from_tensor(request, timeout_s=timeout_s)


def _rollouts(n: int, model, device: str = "cpu") -> list[RolloutWorker]:
    workers = []
    for i in range(n):
        w = RolloutWorker(rank=i, gen_world_size=n, device=device, timeout_s=10.0)
        w.params = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
        workers.append(w)
    return workers


def _exact(workers: list[RolloutWorker], want: dict[str, torch.Tensor]) -> bool:
    return all(set(w.params) == set(want) and all(torch.equal(w.params[k].cpu(), want[k]) for k in want)
               for w in workers)


def sglang_rank(rank: int, spec: SglangSpec) -> dict[str, Any]:
    torch.set_num_threads(1)
    config = get_preset("tiny")

    async def main() -> dict[str, Any]:
        model = build_model(config, seed=0, device=spec.device)
        w = SglangTrainer(model, rank=rank, world_size=spec.world, device=spec.device, timeout_s=spec.timeout_s)
        if spec.update_backend is None:
            await w.init_collective("127.0.0.1", spec.port, spec.world, train_world_size=spec.world)
        else:
            group = await w._run(new_group, host="127.0.0.1", port=spec.port, rank=rank, world_size=spec.world,
                                 name="model_update", backend=spec.update_backend, timeout_s=spec.timeout_s)
            w._replace_group("model_update_group", group)
        out: dict[str, Any] = {"layouts": [], "outcomes": []}
        state = w._refit_transport_state("sglang_ipc")
        for i, layout in enumerate(spec.layouts):
            before = state.get("group")
            if i == 0:  # the setup, through the road; the shim keeps it for the next layouts
                offsets = layout.get("engine_gpu_offsets")
                await w.attach_transport("sglang_ipc", engine_gpu_counts=tuple(layout["engine_gpu_counts"]),
                                         engine_gpu_offsets=None if offsets is None else tuple(offsets),
                                         bucket_bytes=spec.bucket_bytes, buffers=spec.buffers)
            else:
                await w.connect_sglang_rollout_engines(**layout)
            group = state["group"]
            out["layouts"].append({"same_group": group is before, "engine": state["engine_index"],
                                   "group_rank": state["group_rank"], "src": state["gather_src"],
                                   "size": None if group is None else group.world_size,
                                   "epoch": state["epoch"]})
        is_src = state["group"] is not None and state["group_rank"] == 0
        engine = workers = None
        if is_src:
            n = state["layout"].counts[state["engine_index"]]
            workers = _rollouts(n, model, spec.device)
            if spec.engine == "http":
                engine = SglangHttpEngine(f"http://127.0.0.1:{spec.http_port}", timeout_s=5.0)
            elif spec.fail:
                engine = RefusingEngine(workers, fail=spec.fail)
            else:
                engine = InProcessSglangEngine(workers)
        for version in range(1, spec.refits + 1):
            new = seeded_state_dict(config, seed=version)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(new[name])
            try:
                rep = await w.sglang_refit(engine=engine, refit_timeout_s=20.0)
                row: dict[str, Any] = {"ok": True, "version": rep.version, "bytes": rep.bytes,
                                       "buckets": rep.buckets}
            except PolicyWorkerError as exc:
                row = {"ok": False, "error": type(exc).__name__, "message": str(exc)[:300]}
            if workers is not None:
                row["rollout_version"] = workers[0].weight_version
                row["torn"] = workers[0].torn
                row["exact"] = _exact(workers, new) if row["ok"] else None
            out["outcomes"].append(row)
        if isinstance(engine, InProcessSglangEngine):
            out["opened_buffers"] = len(engine._buffers)
            engine.close()
        # Every rank exits only after the engine let go of the peers' (CUDA) buffers.
        await w._run(w.model_update_group.barrier, deadline=time.monotonic() + spec.timeout_s)
        for r in workers or []:
            await r.shutdown()
        await w.shutdown()
        return out

    return asyncio.run(main())


# -- a stand-in SGLang HTTP server --------------------------------------------------
class FakeSglangServer:
    """Records ``POST /update_weights_from_tensor`` JSON bodies and answers by ``mode``.

    Blobs are only base64-decoded and measured, never unpickled. Modes: ``ok``,
    ``refuse`` (400, success false), ``error`` (500), ``missing`` (404), ``slow``
    (answers after ``delay_s``), ``garbage`` (200, not JSON), ``refuse_after`` (ok for
    the first ``after`` requests, then refuse).
    """

    def __init__(self, mode: str = "ok", *, delay_s: float = 0.0, after: int = 0) -> None:
        self.mode, self.delay_s, self.after = mode, delay_s, after
        self.requests: list[dict[str, Any]] = []
        self.blob_sizes: list[list[int]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output quiet
                return None

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                server.requests.append({k: v for k, v in body.items() if k != "serialized_named_tensors"}
                                       | {"path": self.path, "entries": len(body["serialized_named_tensors"])})
                server.blob_sizes.append([len(base64.b64decode(b, validate=True))
                                          for b in body["serialized_named_tensors"]])
                mode = server.mode
                if mode == "refuse_after":
                    mode = "ok" if len(server.requests) <= server.after else "refuse"
                if mode == "slow":
                    threading.Event().wait(server.delay_s)
                status, payload = {
                    "ok": (200, {"success": True, "message": "Success"}),
                    "slow": (200, {"success": True, "message": "Success"}),
                    "refuse": (400, {"success": False, "message": "shape mismatch"}),
                    "error": (500, {"detail": "boom"}),
                    "missing": (404, {"detail": "Not Found"}),
                    "garbage": (200, None),
                }[mode]
                data = b"<html>" if payload is None else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client gave up (timeout test)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> FakeSglangServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)


def http_rank(rank: int, spec: SglangSpec, mode: str, after: int) -> dict[str, Any]:
    """Rank 0 hosts the fake server, then both ranks refit through it."""
    if rank != 0:
        return sglang_rank(rank, spec)
    server = FakeSglangServer(mode, after=after)
    with server:
        spec.http_port = server.port
        out = sglang_rank(rank, spec)
    out["requests"] = server.requests
    out["blob_sizes"] = server.blob_sizes
    return out
