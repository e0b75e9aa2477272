"""Failure paths of a real vLLM engine, run by test_vllm.py (tp=1) and test_vllm_tp2.py (tp=2).

Each case makes one weight-transfer call fail, checks that the controller catches
policyworker's own error type through ``typed_errors()`` (vLLM hands it only text), that
nothing of the failed version is served, that the *next* call answers for itself (at
tp=2 vLLM's executor used to hand back the previous call's queued reply), and that the
next refit commits: vLLM's greedy tokens equal Hugging Face transformers' on the same
weights.
"""

from __future__ import annotations

import time

import pytest

from policyworker import errors
from policyworker.runtime.procs import free_port
from policyworker.errors import ConfigError, PeerLost, PolicyWorkerError, RefitTimeout, TornWeights, TransportError
from policyworker.integrations.vllm.backend import typed_errors


def served_at_least_v1(world) -> None:
    """A case run alone: connect and commit a first version."""
    if world.version == 0:
        world.history[0] = world.tokens()
        assert all(r["ok"] for r in world.connect(version=0))
        assert world.refit(1)[0] is None
        world.version, world.history[1] = 1, world.tokens()


def assert_serves(world, v: int) -> None:
    assert world.tokens() == world.history[v]
    assert world.llm.get_weight_version() == str(v)


def refit_commits(world, v: int) -> None:
    """The next refit (``v``) commits on every rank: tokens are HF's for ``v``."""
    error, replies = world.refit(v)
    assert error is None, error
    assert [r["version"] for r in replies] == [v] * world.spec.n_train, replies
    got = world.tokens()
    assert got == world.oracle(v) and got != world.history[world.version]
    assert world.llm.get_weight_version() == str(v)
    world.version, world.history[v] = v, got


def refused_version(world) -> None:
    served_at_least_v1(world)
    v = world.version
    # The trainers are not told to send: a refused update must not wait for their bytes.
    for stale in (v, v - 1):
        if stale < 1:
            continue
        world.llm.start_weight_update()
        with pytest.raises(ConfigError, match=r"update_info.version .* not newer") as info:
            with typed_errors():
                world.llm.update_weights({"update_info": {"version": stale}})
        assert info.value.rank == 0  # the lowest failed rank's error, every rank agreed on it
        assert "[policyworker-error:" not in str(info.value)
    # A bad init_info is refused by every rank before anything changes.
    with pytest.raises(ConfigError, match=r"init_info.commit must be"):
        with typed_errors():
            world.llm.init_weight_transfer_engine({"init_info": {"host": "127.0.0.1", "update_port": 1,
                                                                  "stage_ports": [2], "trainers_per_stage": [2],
                                                                  "commit": "in-place"}})
    assert_serves(world, v)
    # The groups are intact (nothing was posted): the next call answers for itself and
    # the next version commits.
    refit_commits(world, v + 1)


def failed_commit(world) -> None:
    """A finish without a complete refit is refused (``ConfigError``) with nothing changed
    (live bytes, torn flag, vLLM's tokens)."""
    served_at_least_v1(world)
    v = world.version
    before = live_digests(world)
    world.llm.start_weight_update()
    with pytest.raises(ConfigError, match=r"no complete refit was received"):
        with typed_errors():
            world.llm.finish_weight_update(weight_version=str(v + 1))
    assert live_digests(world) == before and _engine_torn(world) == [False] * world.tp
    assert_serves(world, v)
    _resend_and_commit(world, v + 1)  # vLLM keeps the session open after a failed finish
    refit_commits(world, v + 2)


def deadline(world, deadline_s: float = 2.0) -> None:
    served_at_least_v1(world)
    v = world.version
    world.llm.start_weight_update()
    t0 = time.monotonic()
    with pytest.raises(RefitTimeout) as info:  # the trainers never send
        with typed_errors():
            world.llm.update_weights({"update_info": {"version": v + 1, "refit_timeout_s": deadline_s}})
    elapsed = time.monotonic() - t0
    assert elapsed < deadline_s + 10.0, elapsed
    assert isinstance(info.value.rank, int)
    assert_serves(world, v)
    # The deadline aborted the engine's groups: every side joins fresh ones (the
    # documented recovery), then the next version commits.
    replies = world.connect(version=v)
    assert all(r["ok"] for r in replies), replies
    refit_commits(world, v + 1)


def dead_trainer(world) -> None:
    served_at_least_v1(world)
    v = world.version
    error, replies = world.refit(v + 1, die={1: 3})
    assert isinstance(error, PeerLost), error
    assert replies[0]["ok"] is False and replies[0]["error"] == "PeerLost", replies
    assert world.pool.wait_dead(1, 10.0) == -9
    # Nothing of v + 1 is served.
    assert_serves(world, v)
    assert world.tokens() == world.oracle(v)
    # A replacement trainer joins fresh groups with the survivor and the engine: the
    # engine's init answers for itself, and the next refit commits.
    world.pool.start(1)
    replies = world.connect(version=v)
    assert all(r["ok"] for r in replies), replies
    refit_commits(world, v + 1)


def init_without_trainers(world, timeout_s: float = 2.0) -> None:
    """No trainer hosts the groups: init raises a typed error within its bound, changes
    nothing served, and the next init (trainers present) and refit work."""
    served_at_least_v1(world)
    v = world.version
    info = {"host": "127.0.0.1", "update_port": free_port(), "stage_ports": [free_port()],
            "trainers_per_stage": [world.spec.n_train], "timeout_s": timeout_s}
    t0 = time.monotonic()
    with pytest.raises(TransportError):
        with typed_errors():
            world.llm.init_weight_transfer_engine({"init_info": info})
    # Bound: one group formation (the first never forms), plus process slack.
    assert time.monotonic() - t0 < 2 * timeout_s + 15.0
    assert_serves(world, v)
    replies = world.connect(version=v)
    assert all(r["ok"] for r in replies), replies
    refit_commits(world, v + 1)


def fail_once_on(world, rank: int, step: str) -> None:
    """Make vLLM rank ``rank``'s next ``step`` ("prepare": the post-processing, "commit": the
    swap) raise once, inside the real worker process (vLLM runs this function there)."""

    def inject(worker) -> bool:
        engine = worker.weight_transfer_engine
        if engine.tp_rank != rank:
            return False
        stage = engine._stage
        original = getattr(stage, step)

        def failing(*args, **kwargs):
            setattr(stage, step, original)  # once
            raise RuntimeError(f"injected {step} failure on vLLM rank {rank}")

        setattr(stage, step, failing)
        return True

    assert sum(world.llm.collective_rpc(inject)) == 1


def _received_then(world, v: int, step: str):
    """Trainers send ``v`` and vLLM receives it; then rank 0's ``step`` fails in finish."""
    world.pool.send({"cmd": "refit", "version": v})
    world.llm.start_weight_update()
    world.llm.update_weights({"update_info": {"version": v}})
    assert [r["version"] for r in world.pool.replies(world.spec.refit_timeout_s)] == [v] * world.spec.n_train
    fail_once_on(world, 0, step)  # rank 0: at tp=2 not the rank whose reply vLLM reads
    with pytest.raises(PolicyWorkerError, match=f"injected {step} failure on vLLM rank 0") as info:
        with typed_errors():
            world.llm.finish_weight_update(weight_version=str(v))
    return info.value


def _resend_and_commit(world, v: int) -> None:
    """In the session vLLM kept open: receive ``v`` again, then finish; HF's tokens."""
    world.pool.send({"cmd": "refit", "version": v})
    world.llm.update_weights({"update_info": {"version": v}})
    world.llm.finish_weight_update(weight_version=str(v))
    world.llm.reset_prefix_cache()
    assert [r["version"] for r in world.pool.replies(world.spec.refit_timeout_s)] == [v] * world.spec.n_train
    got = world.tokens()
    assert got == world.oracle(v) and got != world.history[world.version]
    assert world.llm.get_weight_version() == str(v)
    world.version, world.history[v] = v, got


def postprocess_fails_on_one_rank(world) -> None:
    """Every rank post-processes before any swaps: one rank's failure swaps nothing anywhere."""
    served_at_least_v1(world)
    v = world.version
    _received_then(world, v + 1, "prepare")
    assert_serves(world, v)  # no rank swapped: no mix of versions
    _resend_and_commit(world, v + 2)  # the trainers' next version
    refit_commits(world, v + 3)


def swap_fails_on_one_rank(world) -> None:
    """A failed swap marks the engine torn on every rank; a full refit commits and clears it."""
    served_at_least_v1(world)
    v = world.version
    _received_then(world, v + 1, "commit")
    assert _engine_torn(world) == [True] * world.tp
    with pytest.raises(TornWeights):  # every rank refuses until a full refit commits
        with typed_errors():
            world.llm.finish_weight_update(weight_version=str(v + 1))
    _resend_and_commit(world, v + 2)
    refit_commits(world, v + 3)


def staging_commit_failures(world, mode: str) -> None:
    """Staging ``mode``: :func:`failed_commit`, then :func:`swap_fails_on_one_rank`."""
    served_at_least_v1(world)
    assert all(r["ok"] for r in world.connect(version=world.version, staging=mode))
    failed_commit(world)
    swap_fails_on_one_rank(world)
    assert _engine_torn(world) == [False] * world.tp, mode


def landing_fails_on_one_rank(world) -> None:
    """``staging="none"``: a layer's post-processing fails on rank 0 while the refit lands
    layer by layer (.landing): ``update_weights`` raises a typed error, the trainers learn
    it in the verdict, the engine is torn on every rank (layers before it are live), and a
    full refit heals it (HF's tokens)."""
    served_at_least_v1(world)
    v = world.version
    assert all(r["ok"] for r in world.connect(version=v, staging="none"))
    before = live_digests(world)
    fail_once_on(world, 0, "_post_process")
    error, replies = world.refit(v + 1)
    assert isinstance(error, TransportError), error
    if world.tp == 1:  # at tp=2 vLLM reads another rank's reply: "1 rank(s) failed to receive it"
        assert "could not take over the landed" in str(error) and "injected _post_process failure" in str(error)
    assert [r["ok"] for r in replies] == [False] * world.spec.n_train, replies
    assert _engine_torn(world) == [True] * world.tp
    assert live_digests(world) != before  # the layers before the failing one are live
    _recovers(world, "none", v)


def staging_report(world) -> list[dict]:
    """Each vLLM rank's ``engine.staging_report`` (read inside the workers)."""
    return world.llm.collective_rpc(lambda worker: worker.weight_transfer_engine.staging_report)


def _engine_torn(world) -> list[bool]:
    return world.llm.collective_rpc(lambda worker: worker.weight_transfer_engine.torn)


def staging_modes(world, modes=("device", "host", "none")) -> None:
    """Each staging mode on the same engine: a refit commits (HF's tokens), the report says
    which mode and what it holds, and a trainer killed mid-refit leaves the old version
    served ("device", "host") or the engine torn until a full refit heals it ("none")."""
    served_at_least_v1(world)
    for mode in modes:
        v = world.version
        replies = world.connect(version=v, staging=mode)
        assert all(r["ok"] for r in replies), replies
        if mode == "none":  # an overlapped update would write what vLLM reads while it generates
            world.llm.start_weight_update()
            with pytest.raises(ConfigError, match=r"update_info.overlap with staging='none'"):
                with typed_errors():
                    world.llm.update_weights({"update_info": {"version": v + 1, "overlap": True}})
        before = live_digests(world)
        error, replies = world.refit(v + 1, die={1: 3})
        assert isinstance(error, PeerLost), (mode, error)
        assert world.pool.wait_dead(1, 10.0) == -9
        _left_as_documented(world, mode, v, before)
        world.pool.start(1)
        _recovers(world, mode, v)


def _left_as_documented(world, mode: str, v: int, before: list[dict[str, str]] | None = None) -> None:
    """After a failed refit of ``v + 1``: "none" is torn on every rank, the others serve ``v``
    untouched (HF's tokens); ``before``: the live digests before it, of which some rank's
    changed iff torn (bytes, not only the flag: a rank is torn too when only another's changed)."""
    torn = mode == "none"
    assert _engine_torn(world) == [torn] * world.tp, mode
    if before is not None:
        assert any(a != b for a, b in zip(live_digests(world), before)) == torn, mode
    if not torn:
        assert_serves(world, v)
        assert world.tokens() == world.oracle(v)


def _recovers(world, mode: str, v: int) -> None:
    """Every side joins fresh groups; "none" refuses to commit until a full refit heals it;
    then ``v + 1`` commits (HF's tokens) and the report says what the mode holds."""
    assert all(r["ok"] for r in world.connect(version=v, staging=mode))
    if mode == "none":
        world.llm.start_weight_update()
        with pytest.raises(TornWeights):  # refuses to commit anything but a full refit
            with typed_errors():
                world.llm.finish_weight_update(weight_version=str(v + 1))
        _resend_and_commit(world, v + 1)  # a full refit in the session vLLM kept open heals it
    else:
        refit_commits(world, v + 1)  # tokens are HF's
    assert _engine_torn(world) == [False] * world.tp, mode
    _check_report(world, mode)


def live_digests(world) -> list[dict[str, str]]:
    """Per vLLM rank, a sha256 of every parameter and buffer its live model holds."""

    def digest(worker) -> dict[str, str]:
        import hashlib

        import torch

        model = worker.weight_transfer_engine.model
        tensors = [*model.named_parameters(), *model.named_buffers()]
        return {name: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                for name, t in tensors}

    return world.llm.collective_rpc(digest)


def staging_deadline(world, mode: str, deadline_s: float = 2.0) -> None:
    """A trainer that stalls mid-refit (SIGSTOP after its 3rd wait) past the refit's deadline:
    ``update_weights`` raises ``RefitTimeout`` within the deadline (plus process slack) and
    leaves what the mode promises (:func:`_left_as_documented`); the stalled trainer
    resumes and reports a typed failure of its own, every side joins fresh groups (the
    deadline aborted the engine's), and the next refit commits."""
    served_at_least_v1(world)
    v = world.version
    assert all(r["ok"] for r in world.connect(version=v, staging=mode))
    before = live_digests(world)
    for rank in range(world.spec.n_train):  # every side gets this refit's deadline
        cmd = {"cmd": "refit", "version": v + 1, "refit_timeout_s": deadline_s}
        world.pool.send({**cmd, "stall_after_waits": 3} if rank == 1 else cmd, [rank])
    world.llm.start_weight_update()
    t0 = time.monotonic()
    try:
        with pytest.raises(RefitTimeout) as info:
            with typed_errors():
                world.llm.update_weights({"update_info": {"version": v + 1, "refit_timeout_s": deadline_s}})
        elapsed = time.monotonic() - t0
    finally:
        world.pool.resume(1)
    assert elapsed < deadline_s + 10.0, elapsed
    assert isinstance(info.value.rank, int)
    replies = world.pool.replies(world.spec.refit_timeout_s)
    for r in replies:  # each trainer's own refit failed, typed (the loop replies ok=False for ours only)
        assert r["ok"] is False and not r.get("fatal") and issubclass(getattr(errors, r["error"]), PolicyWorkerError), r
    _left_as_documented(world, mode, v, before)
    _recovers(world, mode, v)


def _check_report(world, mode: str) -> None:
    reports = staging_report(world)
    assert [r["mode"] for r in reports] == [mode] * world.tp, reports
    for r in reports:
        assert r["requested"] == mode and r["set_bytes"] > 0, r
        # never more than one extra set; "none" holds nothing once its commit is live
        assert 0 <= r["extra_bytes_steady"] <= r["extra_bytes_peak"] <= r["set_bytes"], r
        assert r["extra_bytes_steady"] == (0 if mode == "none" else r["set_bytes"]), r


def staging_refused(world) -> None:
    """Bad values and combinations a mode cannot do: a typed ConfigError at init, nothing changed."""
    served_at_least_v1(world)
    v = world.version
    base = {"host": "127.0.0.1", "update_port": 1, "stage_ports": [2], "trainers_per_stage": [2]}
    for extra, match in (({"staging": "gpu"}, r"init_info.staging must be one of"),
                         ({"staging": "none", "overlap": True}, r"staging='none' .* cannot overlap"),
                         ({"staging": "none", "reshard_options": {"delta": True}}, r"staging='none' cannot apply delta"),
                         ({"staging": "none", "cpu_linear": "background"}, r"staging='none' cannot prepack")):
        with pytest.raises(ConfigError, match=match):
            with typed_errors():
                world.llm.init_weight_transfer_engine({"init_info": {**base, **extra}})
    assert_serves(world, v)
