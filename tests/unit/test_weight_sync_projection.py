"""The weight-sync projection (tools/weight_sync_projection.py): the model's bytes by how the
learner splits them against transformers' own model of the same config, and the overlapped
time's closed form against a step-by-step run of the bucket loop's rule; groups of k engines
(the wire paid once per group, the reshard once) against the formula written out, and the
printed projection without --engines-per-group as it was."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_qwen import TINY

from megatron_fr.models.hf_config import PRESET_DIR, load_hf_config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from weight_sync_projection import (  # noqa: E402
    group_count,
    main,
    model_bytes,
    received_bytes,
    sync_seconds,
)


def transformers_bytes(config: dict) -> dict[str, int]:
    """Parameter bytes of transformers' model (bf16, on meta), by name: experts, replicated
    (norms, MoE router), the rest split over TP."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    kwargs = {key: value for key, value in config.items() if key != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            CONFIG_MAPPING[config["model_type"]](**kwargs), dtype=torch.bfloat16
        )
    split = {"experts": 0, "replicated": 0, "dense_sharded": 0}
    for name, parameter in model.named_parameters():
        if ".experts." in name:
            kind = "experts"
        elif "norm" in name or name.endswith(".mlp.gate.weight"):
            kind = "replicated"
        else:
            kind = "dense_sharded"
        split[kind] += parameter.numel() * parameter.element_size()
    return split


@pytest.mark.parametrize(
    "config",
    [
        json.loads((PRESET_DIR / "qwen3-30b-a3b.json").read_text()),
        TINY["qwen2"] | {"model_type": "qwen2"},  # dense, tied embeddings, q/k/v biases
    ],
    ids=["qwen3-30b-a3b", "tiny-qwen2"],
)
def test_model_bytes_match_transformers_model(config):
    sizes = model_bytes(load_hf_config(config))
    expected = transformers_bytes(config)
    assert (sizes.experts, sizes.replicated, sizes.dense_sharded) == (
        expected["experts"],
        expected["replicated"],
        expected["dense_sharded"],
    )


def test_the_flagship_sender_receives_all_but_its_own_shards():
    sizes = model_bytes(load_hf_config("qwen3-30b-a3b"))
    assert round(sizes.total / 1e9, 1) == 61.1
    got = received_bytes(sizes, tp=4, ep=8, etp=1)
    assert got == pytest.approx(sizes.dense_sharded * 3 / 4 + sizes.experts * 7 / 8)
    assert received_bytes(sizes, tp=1, ep=1, etp=1) == 0


def bucket_loop(n: int, r: float, w: float) -> float:
    """The BucketSender rule step by step: the main thread builds bucket k + 1 once bucket k
    was handed over, and hands it over once bucket k is sent; the end of the last send."""
    handed, sent = 0.0, 0.0  # when bucket k was handed over / finished sending
    built = r
    for _ in range(n):
        handed = max(built, sent)  # submit waits for the previous send
        sent = handed + w
        built = handed + r  # the next is built from the hand-over on
    return sent


@pytest.mark.parametrize(("reshard", "wire"), [(10.0, 2.0), (2.0, 10.0), (5.0, 5.0)])
def test_overlapped_time_is_the_bucket_loop_and_in_line_the_sum(reshard, wire):
    total, bucket = 10 * 2**20, 2**20  # ten buckets
    gbps = total * 8 / (wire * 1e9)  # a wire taking `wire` seconds for everything
    t = sync_seconds(total, reshard, gbps, bucket, overhead_s=0.0)
    assert t["buckets"] == 10 and t["wire"] == pytest.approx(wire)
    assert t["overlapped"] == pytest.approx(bucket_loop(10, reshard / 10, wire / 10))
    assert t["in_line"] == pytest.approx(reshard + wire)
    with_cost = sync_seconds(total, reshard, gbps, bucket, overhead_s=0.1)
    assert with_cost["in_line"] == pytest.approx(reshard + wire + 10 * 0.1)


def test_groups_pay_the_wire_once_each_and_the_reshard_once():
    # 4 engines, k = 1: 4 groups. Ten 1 MiB buckets, R = 10 s, W = 2 s for one group, c = 0.1 s:
    # in line 10 + 4 x 2 + 10 x 4 x 0.1 = 22 s; overlapped r = 1 s, w = 4 x 2 / 10 + 4 x 0.1
    # = 1.2 s: 1 + 9 x 1.2 + 1.2 = 13 s.
    assert [group_count(4, k) for k in (1, 2, 3, 4, None)] == [4, 2, 2, 1, 1]
    total, bucket = 10 * 2**20, 2**20
    gbps = total * 8 / (2.0 * 1e9)
    t = sync_seconds(total, 10.0, gbps, bucket, overhead_s=0.1, groups=4)
    assert t["reshard"] == 10.0 and t["wire"] == pytest.approx(8.0)
    assert t["in_line"] == pytest.approx(22.0)
    assert t["overlapped"] == pytest.approx(13.0)
    assert t["overlapped"] == pytest.approx(bucket_loop(10, 1.0, 1.2))
    # k = all, one group: in line 10 + 2 + 10 x 0.1 = 13 s; overlapped w = 0.2 + 0.1 = 0.3 s,
    # so the reshard bounds it: 1 + 9 x 1 + 0.3 = 10.3 s
    one = sync_seconds(total, 10.0, gbps, bucket, overhead_s=0.1)
    assert (one["in_line"], one["overlapped"]) == (pytest.approx(13.0), pytest.approx(10.3))


BENCH = {"layout": "TP1xEP2", "received": [500_000_000, 500_000_000], "reshard_s": 4.0}
TODAY = """\
qwen3-30b-a3b in qwen3_30b_a3b_lag8.yaml: TP4 EP8 ETP1 PP1, 512 MiB buckets
  S = 61.1 GB (split over TP: 3.06, experts: 57.98, replicated: 0.03)
  G = 53.0 GB received by the sender; reshard rate: measured 0.25 GB/s (TP1xEP2, bench.json)
  fixed cost per bucket c = 0 ms; anchors: verl checkpoint engine ~7 s; slime, 512 MiB \
buckets: 10-16 s
 wire Gb/s  buckets     R s     W s  in line s  overlapped s
       100      114  212.11    4.89     216.99        212.15
       200      114  212.11    2.44     214.55        212.13
       400      114  212.11    1.22     213.33        212.12
"""


def project(tmp_path, capsys, *options: str) -> str:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    main([str(bench), *options])
    return capsys.readouterr().out


def test_the_default_projection_prints_what_it_did(tmp_path, capsys):
    assert project(tmp_path, capsys) == TODAY


def test_engines_per_group_adds_a_row_per_k_and_wire(tmp_path, capsys):
    out = project(tmp_path, capsys, "--engines-per-group", "--gather-gbps", "1600")
    lines = out.splitlines()
    assert "4 engines (cluster.servers)" in lines[8]  # the recipe's four SGLang TP4 servers
    rows = [line.split() for line in lines[10:]]
    assert [(row[0], row[1], row[2], row[3]) for row in rows] == [
        (k, g, out_, gbps)
        for k, g, out_ in (("1", "4", "1"), ("2", "2", "2"), ("all", "1", "4"))
        for gbps in ("100", "200", "400")
    ]
    # the one-group rows are the default table's; k = 1 sends the 61.1 GB four times
    default = {line.split()[0]: line.split() for line in lines[5:8]}
    for row in rows[6:]:
        assert row[4:] == [default[row[3]][3], default[row[3]][4], default[row[3]][5]]
    wire_400 = float(default["400"][3])
    assert float(rows[2][4]) == pytest.approx(4 * wire_400, abs=0.02)
    assert lines[:8] == project(tmp_path, capsys, "--gather-gbps", "1600").splitlines()
