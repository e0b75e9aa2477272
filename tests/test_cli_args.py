"""The command line fails early and plainly: bad input is one line and exit code 2,
before any process starts (each case here returns in well under a second)."""

from __future__ import annotations

import json
import time

import pytest

from policyworker.cli import main

pytestmark = pytest.mark.timeout(60)

BAD = [
    (["demo", "--train", "tp=3"], "PlanError: tp=3 does not divide num_heads=8"),
    (["demo", "--refits", "0"], "--refits: 0 is below the minimum 2"),
    (["demo", "--refits", "1"], "--refits: 1 is below the minimum 2"),
    (["demo", "--preset", "nope"], "ConfigError: unknown model preset 'nope'"),
    (["demo", "--engine", "vllm", "--train", "tp=3"], "ConfigError: demo --engine vllm runs its own tiny Qwen3"),
    (["demo", "--timeout", "-1"], "--timeout: -1 must be a finite number > 0"),
    (["bench", "--transport", "nccl_reshard", "--bucket-mb", "0"], "--bucket-mb: 0 must be a finite number > 0"),
    (["bench", "--transport", "nccl_reshard", "--train", "tp=5"], "PlanError"),
    (["bench", "--transport", "nccl_reshard", "--dtype", "int7"], "ConfigError: dtype must name a torch floating"),
    (["plan", "--preset", "small", "--train", "tp=2", "--gen", "tp=1", "--bucket-mb", "-5"],
     "--bucket-mb: -5 must be a finite number > 0"),
    (["plan", "--preset", "small", "--train", "tp=2", "--gen", "tp=1", "--bucket-mb", "0"],
     "--bucket-mb: 0 must be a finite number > 0"),
    (["plan", "--preset", "small", "--train", "tp=2", "--gen", "tp=1", "--json", "/nonexistent/x.json"],
     "--json: directory '/nonexistent' does not exist"),
    (["plan", "--model", "/nonexistent/config.json", "--train", "tp=2", "--gen", "tp=1"],
     "ConfigError: model config '/nonexistent/config.json' does not exist"),
    (["bench"], "ConfigError: bench needs --transport"),
    (["drill", "--jobs", "0"], "--jobs: 0 is below the minimum 1"),
    (["bench", "--transport", "nccl_reshard", "--engines", "2"], "ConfigError: bench --engines 2 refits two tp=1"),
    (["bench", "--engine", "vllm", "--engines", "2", "--vllm-tp", "2"], "ConfigError: bench --engines 2 refits two"),
    (["bench", "--engine", "vllm", "--engines", "3"], "--engines: invalid choice: 3"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    began = time.monotonic()
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("policyworker")]
    assert len(lines) == 1, err  # one error line (argparse also prints its usage above it)
    assert time.monotonic() - began < 10  # no world was started


def test_plan_reads_a_hugging_face_config(tmp_path, capsys):
    """plan sizes a user's model from its config.json (file or directory), not only presets."""
    config = {"model_type": "qwen3", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "rope_theta": 1e6, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "plan.json"
    for ref in (str(tmp_path), str(tmp_path / "config.json")):
        assert main(["plan", "--model", ref, "--train", "tp=2", "--gen", "tp=1", "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        h, i, v, hd = 256, 512, 1024, 64
        per_layer = (4 * hd * h) + 2 * (2 * hd * h) + (h * 4 * hd) + 3 * (h * i) + 2 * h + 2 * hd
        params = 2 * per_layer + 2 * v * h + h
        assert report["min_bytes"] == params * 2  # bf16: every element once
        assert report["train"]["tp"] == 2 and report["gen"]["tp"] == 1
    capsys.readouterr()


def test_plan_rejects_a_model_type_the_rules_cannot_place(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    assert main(["plan", "--model", str(tmp_path), "--train", "tp=1", "--gen", "tp=1"]) == 2
    assert "ConfigError: model_type 'gpt2' is not supported" in capsys.readouterr().err


def test_help_prints_no_rst_markup(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out
