"""The fabric model: small cases whose numbers are worked out by hand here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policyworker.cli import main as cli_main
from policyworker.errors import ConfigError
from policyworker.layout import build_plan
from policyworker.layout.fabric import (
    Fabric,
    Placement,
    fabric_report,
    load_fabric,
    ordered_time,
)

US = 1e-6
# One param, 1,000 x 500 bf16 = 1,000,000 bytes; vocab-parallel (rows split over tp).
SPECS = {"lm_head.weight": ((1000, 500), "bfloat16")}


def _plan(train: str = "tp=2", gen: str = "tp=2"):
    from policyworker.layout import Parallelism
    t, g = Parallelism.parse(train), Parallelism.parse(gen)
    return build_plan(SPECS, t, g, t.world_size, g.world_size)


def test_link_kinds_and_default_placement() -> None:
    f = Fabric(gpus_per_node=2, nvlink_gbps=100, nic_gbps=10)
    assert (f.kind(3, 3), f.kind(0, 1), f.kind(1, 2)) == ("local", "nvlink", "nic")
    assert Fabric(gpus_per_node=2, nvlink_domain_gpus=4, nvlink_gbps=1, nic_gbps=1).kind(1, 2) \
        == "nvlink"
    # 3 trainers on GPUs 0-2; generation starts at the next node boundary, GPU 4.
    assert f.place(3, 2) == Placement((0, 1, 2), (4, 5))
    with pytest.raises(ConfigError, match="lists 1 GPUs for 2 gen ranks"):
        Fabric(gpus_per_node=2, nvlink_gbps=1, nic_gbps=1, gen_gpus=[7]).place(2, 2)


def test_tp2_to_tp2_across_nodes() -> None:
    # Trainers on node 0 (GPUs 0, 1), generation on node 1 (GPUs 2, 3); NVLink 100 GB/s,
    # NIC 10 GB/s. Plan: each trainer sends its 500,000 bytes to one generation rank
    # over its NIC: 500e3 / 10e9 = 50 us.
    f = Fabric(gpus_per_node=2, nvlink_gbps=100, nic_gbps=10, bucket_mb=1)
    d = fabric_report(_plan(), f)
    assert d["plan"]["bytes_by_kind"] == {"nvlink": 0, "nic": 1_000_000, "local": 0}
    assert d["plan"]["bound_s"] == pytest.approx(50 * US)
    assert d["plan"]["ordered_s"] == pytest.approx(50 * US)   # one round of 500 kB each
    # Full tensors: each generation rank takes all 1e6 bytes, 500 kB from each trainer;
    # each trainer's NIC sends 2 x 500 kB: 1e6 / 10e9 = 100 us.
    assert d["full_tensor"]["bound_s"] == pytest.approx(100 * US)
    assert d["full_tensor"]["bytes_by_kind"]["nic"] == 2_000_000
    # Broadcast: rank 0 lacks rows 500:1000 (500 kB), held by rank 1 on its node:
    # NVLink 500e3 / 100e9 = 5 us. Then the multi-ring broadcast into node 1 runs at
    # min(100, 2 NICs x 10) = 20 GB/s: 1e6 / 20e9 = 50 us. Fills: the model fits one
    # 1 MiB bucket, so it is gathered (5 us) before it is broadcast; each of the 2 rings
    # carries 500 kB, its chunk min(512 KiB, 500 kB), and the ring's last rank (GPU 3)
    # is one NIC hop (500e3 / 10e9 = 50 us) and one NVLink hop (5 us) from the root:
    # 5 + 50 + 55 = 110 us, pipelined or in turn alike.
    b = d["broadcast"]
    assert b["gather_s"] == pytest.approx(5 * US)
    assert b["broadcast_s"] == pytest.approx(50 * US)
    assert b["ring_fill_s"] == pytest.approx(55 * US)
    assert (b["bound_s"], b["sequential_s"]) == (pytest.approx(110 * US), pytest.approx(110 * US))
    assert b["bytes_by_kind"] == {"nvlink": 1_000_000, "nic": 1_000_000, "local": 0}
    assert d["plan"]["received_by_gen_rank"][1] == {"nvlink": 0, "nic": 500_000, "local": 0}


def test_one_nvlink_domain_and_colocated() -> None:
    # A 4-GPU NVLink domain of 2-GPU trays: everything on NVLink (100 GB/s).
    f = Fabric(gpus_per_node=2, nvlink_domain_gpus=4, nvlink_gbps=100, nic_gbps=10)
    d = fabric_report(_plan(), f)
    assert d["plan"]["bound_s"] == pytest.approx(5 * US)           # 500e3 / 100e9
    assert d["broadcast"]["broadcast_s"] == pytest.approx(10 * US)  # 1e6 / 100e9
    assert d["full_tensor"]["bound_s"] == pytest.approx(10 * US)    # 1e6 in per receiver
    # Colocated (generation rank g on GPU g): tp=2 -> tp=2 never leaves a GPU.
    d = fabric_report(_plan(), Fabric(gpus_per_node=2, nvlink_gbps=100, nic_gbps=10,
                                      gen_first_gpu=0))
    assert d["plan"]["bytes_by_kind"] == {"nvlink": 0, "nic": 0, "local": 1_000_000}
    assert d["plan"]["bound_s"] == 0.0
    # ... but tp=2 -> tp=1 moves rank 1's half over NVLink: 500e3 / 100e9 = 5 us.
    d = fabric_report(_plan(gen="tp=1"), Fabric(gpus_per_node=2, nvlink_gbps=100,
                                                nic_gbps=10, gen_first_gpu=0))
    assert d["plan"]["bytes_by_kind"] == {"nvlink": 500_000, "nic": 0, "local": 500_000}
    assert d["plan"]["bound_s"] == pytest.approx(5 * US)


def test_message_order_costs_more_than_the_port_bound() -> None:
    # Every GPU its own node, NICs 1 GB/s, 1,000-byte buckets. Receiver GPU 3 takes two
    # 1-bucket transfers (from GPUs 0 and 1), receiver GPU 4 one 2-bucket transfer (from
    # GPU 2). Port bound: 2,000 bytes on GPU 3's and on GPU 4's NIC = 2 us. Rounds:
    # round 0 puts 2,000 bytes on GPU 3 (2 us), round 1 1,000 on GPU 4 (1 us): 3 us.
    f = Fabric(gpus_per_node=1, nvlink_gbps=100, nic_gbps=1)
    place = Placement((0, 1, 2), (3, 4))
    transfers = [(0, 0, 1000), (1, 0, 1000), (2, 1, 2000)]
    assert ordered_time(f, place, transfers, 1000) == pytest.approx(3 * US)
    # One big bucket: one round, the port bound.
    assert ordered_time(f, place, transfers, 4000) == pytest.approx(2 * US)


def test_fabric_files_and_their_errors(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1] / "benchmarks" / "fabrics"
    for path in sorted(root.iterdir()):
        f = load_fabric(path)
        assert f.gpus_per_node > 0 and f.nic_gbps > 0
    assert load_fabric(root / "gb200-nvl72.json").domain_gpus == 72
    bad = tmp_path / "bad.json"
    for text, match in (('{"gpus_per_node": 8, "nvlink_gbps": 450}', "nic_gbps"),
                        ('{"gpus_per_node": 8, "nvlink_gbps": 450, "nic_gbps": 0}', "nic_gbps"),
                        ('{"gpus_per_node": 8, "nvlink_gbps": 1, "nic_gbps": 1, "nics": 2}',
                         "nics"),
                        ('{"gpus_per_node": 8, "nvlink_gbps": 1, "nic_gbps": 1, '
                         '"nvlink_domain_gpus": 12}', "multiple"),
                        ("{not json", "not valid JSON")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_fabric(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_fabric(tmp_path / "missing.toml")


def test_cli_plan_with_fabric(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    fabric = Path(__file__).resolve().parents[1] / "benchmarks" / "fabrics" / "h100-8x.json"
    assert cli_main(["plan", "--preset", "tiny-moe", "--train", "tp=2,pp=2,dp=2,ep=2",
                     "--gen", "tp=2,dp=2", "--fabric", str(fabric), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "MODEL" in text and "broadcast" in text and "full_tensor" in text
    d = json.loads(out.read_text())["fabric_model"]
    # 8 trainers fill node 0, generation on node 1: all the plan's bytes cross NICs.
    assert d["plan"]["bytes_by_kind"]["nic"] == json.loads(out.read_text())["total_bytes"]
    assert cli_main(["plan", "--preset", "tiny", "--train", "tp=1", "--gen", "tp=1",
                     "--fabric", str(tmp_path / "nope.json")]) == 2
