"""``policyworker drill``: every fault scenario passes, in real processes."""

import json
import subprocess
import sys

import pytest

from policyworker.cli.drill import SCENARIOS

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_drill_every_scenario_passes(tmp_path):
    out = tmp_path / "drill.json"
    proc = subprocess.run([sys.executable, "-m", "policyworker.cli", "drill", "--json", str(out)],
                          capture_output=True, text=True, timeout=580)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["scenarios"]}
    assert set(rows) == set(SCENARIOS) == {
        "kill-rollout-mid-refit", "kill-trainer-mid-refit", "stall-rollout-past-deadline",
        "stand-down-during-refit", "corrupt-bucket", "plan-hash-mismatch", "restart-and-recover",
        "cancel-awaiting-refit",
        "zmq-kill-rollout-mid-refit", "zmq-kill-trainer-mid-refit", "zmq-stall-rollout-past-deadline",
        "zmq-restart-and-recover", "zmq-cancel-awaiting-refit",
        "sglang-engine-refuses-bucket", "sglang-engine-times-out", "sglang-cancel-awaiting-refit",
        "delta-kill-rollout-mid-delta",
    }
    # every built-in transport is drilled, and each has its cancel row
    assert {r["transport"] for r in rows.values()} == {"nccl_reshard", "zmq", "sglang_ipc"}
    for t in ("nccl_reshard", "zmq", "sglang_ipc"):
        assert any(r["transport"] == t and "Cancelled" in r["errors"] for r in rows.values()), t
    for name, row in rows.items():
        assert row["passed"], (name, row)
        assert row["served_torn"] is False and row["recovered"] is True
        assert row["detect_seconds"] is not None
    # a dead peer is noticed by the transport, long before any deadline
    assert rows["kill-rollout-mid-refit"]["detect_seconds"] < 2.0
    assert rows["kill-trainer-mid-refit"]["detect_seconds"] < 2.0
    # zmq: a dead colocated peer is seen at once (the socket monitor), not at the deadline
    for name in ("zmq-kill-rollout-mid-refit", "zmq-kill-trainer-mid-refit", "zmq-restart-and-recover"):
        assert rows[name]["errors"] == ["PeerLost"] and rows[name]["detect_seconds"] < 2.0, rows[name]
    assert "RefitTimeout" in rows["zmq-stall-rollout-past-deadline"]["errors"]
    assert rows["sglang-engine-refuses-bucket"]["errors"] == ["TransportError"]
    assert rows["sglang-engine-times-out"]["errors"] == ["RefitTimeout"]
    # a stalled peer is caught by the deadline: within refit_timeout_s + 2 s
    stall = rows["stall-rollout-past-deadline"]
    assert stall["errors"] == ["RefitTimeout"] or "RefitTimeout" in stall["errors"]
    assert stall["detect_seconds"] <= stall["scenario"]["refit_timeout_s"] + 2.0
    assert rows["plan-hash-mismatch"]["errors"] == ["PlanMismatch"]
    # a rollout killed mid-delta is replaced; the retry is full, the next refit a delta again
    delta = rows["delta-kill-rollout-mid-delta"]["checks"]
    assert delta["full_after_replacement"] and delta["delta_after_recovery"], delta
    assert proc.returncode == 0
