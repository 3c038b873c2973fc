"""The weight-sync projection (tools/weight_sync_projection.py): the model's bytes by how the
learner splits them against transformers' own model of the same config, and the overlapped
time's closed form against a step-by-step run of the bucket loop's rule."""

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
