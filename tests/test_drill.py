"""``policyworker drill``: fault scenarios pass, in real processes.

CI runs the rows the failure matrix (tests/test_failure_matrix.py) does not already
run as cells — a corrupted bucket, restart-and-recover on nccl_reshard and zmq, the
SGLang engine refusing or timing out a bucket, a rollout killed mid-delta — plus one
dead peer per transport for the detection time. The other rows (kills, stalls,
stand-down, cancel, never-calls, stale attempt, SIGINT, mismatches) are the matrix's
fault kinds, asserted there per transport; ``policyworker drill`` runs them all.
"""

import json
import subprocess
import sys

import pytest

from policyworker.cli.drill import SCENARIOS

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ALL = {
    "kill-rollout-mid-refit", "kill-trainer-mid-refit", "stall-rollout-past-deadline",
    "stand-down-during-refit", "corrupt-bucket", "plan-hash-mismatch", "restart-and-recover",
    "cancel-awaiting-refit", "rollout-never-calls", "stale-attempt-arrives-late", "sigint-rollout-mid-refit",
    "options-mismatch-at-connect",
    "zmq-kill-rollout-mid-refit", "zmq-kill-trainer-mid-refit", "zmq-stall-rollout-past-deadline",
    "zmq-restart-and-recover", "zmq-cancel-awaiting-refit",
    "sglang-engine-refuses-bucket", "sglang-engine-times-out", "sglang-cancel-awaiting-refit",
    "delta-kill-rollout-mid-delta",
}
CI_ROWS = ["kill-rollout-mid-refit", "corrupt-bucket", "restart-and-recover", "zmq-restart-and-recover",
           "sglang-engine-refuses-bucket", "sglang-engine-times-out", "delta-kill-rollout-mid-delta"]


def test_the_drill_knows_every_scenario():
    assert set(SCENARIOS) == ALL
    # every built-in transport is drilled, and each has its cancel row
    assert {sc.transport for sc in SCENARIOS.values()} == {"nccl_reshard", "zmq", "sglang_ipc"}


@pytest.mark.timeout(600)
def test_drill_rows_pass(tmp_path):
    out = tmp_path / "drill.json"
    argv = [sys.executable, "-m", "policyworker.cli", "drill", "--json", str(out)]
    for name in CI_ROWS:
        argv += ["--scenario", name]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=580)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["scenarios"]}
    assert set(rows) == set(CI_ROWS)
    for name, row in rows.items():
        assert row["passed"], (name, row)
        assert row["served_torn"] is False and row["recovered"] is True
        assert row["detect_seconds"] is not None
    # a dead peer is noticed by the transport, long before any deadline
    assert rows["kill-rollout-mid-refit"]["detect_seconds"] < 2.0
    assert rows["zmq-restart-and-recover"]["errors"] == ["PeerLost"]
    assert rows["zmq-restart-and-recover"]["detect_seconds"] < 2.0
    assert rows["sglang-engine-refuses-bucket"]["errors"] == ["TransportError"]
    assert rows["sglang-engine-times-out"]["errors"] == ["RefitTimeout"]
    # a rollout killed mid-delta is replaced; the retry is full, the next refit a delta again
    delta = rows["delta-kill-rollout-mid-delta"]["checks"]
    assert delta["full_after_replacement"] and delta["delta_after_recovery"], delta
    assert proc.returncode == 0
