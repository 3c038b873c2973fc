"""weights.bucket_format's default (config/weights.py): flattened buckets on NCCL, where
SGLang 0.5.23 receives a bucket with one broadcast, tensor by tensor on gloo (faster there);
and the bucketing rule tools/bench_weight_sync.py --broadcasts counts with."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_fr.config.weights import WeightSyncConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from bench_weight_sync import bucket_sizes


def test_auto_sends_flattened_buckets_on_nccl_and_tensors_on_gloo():
    default = WeightSyncConfig()
    assert default.bucket_format == "auto"
    assert default.flattened("nccl") and not default.flattened("gloo")
    for backend in ("nccl", "gloo"):
        assert WeightSyncConfig(bucket_format="flattened").flattened(backend)
        assert not WeightSyncConfig(bucket_format="tensors").flattened(backend)


@pytest.mark.parametrize(
    "sizes, bucket, expected",
    [
        ([4, 4, 4], 8, [2, 1]),  # a bucket closes when the next tensor would pass it
        ([10, 1, 1], 8, [1, 2]),  # a bigger tensor goes alone
        ([1] * 5, 100, [5]),
    ],
)
def test_buckets_close_before_they_pass_the_size(sizes, bucket, expected):
    assert bucket_sizes(sizes, bucket) == expected
