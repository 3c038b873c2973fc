"""The learner's reduced step figures (learner/step_metrics.py): the tensor the last pipeline
stage broadcasts is laid out by Reduced's fields, and unpacking it gives back every figure
under its own name, for any batch size."""

from __future__ import annotations

import pytest
import torch

from megatron_fr.learner.step_metrics import PER_TRAJECTORY, SCALARS, Reduced


def test_the_layout_is_the_fields_scalars_first() -> None:
    scalars = ("loss", "acceptance_rate", "clip_fraction", "sequence_kl_mean")
    assert (*scalars, "retained_tokens_mean") == SCALARS
    assert PER_TRAJECTORY == ("admitted", "sequence_kl", "retained_tokens")
    assert Reduced.width(5) == 5 + 3 * 5


@pytest.mark.parametrize("size", [1, 3])
def test_pack_then_unpack_gives_every_figure_back_by_name(size: int) -> None:
    kl = torch.arange(size, dtype=torch.float64) / 8
    admitted = torch.arange(size) % 2 == 0
    values = Reduced.pack(
        {
            "sequence_kl": kl,
            "loss": torch.tensor(0.25),
            "admitted": admitted,
            "clip_fraction": torch.tensor(0.125),
            "acceptance_rate": torch.tensor(0.5),
            "sequence_kl_mean": kl.mean(),
            "retained_tokens": torch.arange(size) * 3,
            "retained_tokens_mean": torch.tensor(1.5),
        }
    )
    assert values.dtype == torch.float64 and values.shape == (Reduced.width(size),)
    assert Reduced.unpack(values, size) == Reduced(
        loss=0.25,
        acceptance_rate=0.5,
        clip_fraction=0.125,
        sequence_kl_mean=kl.mean().item(),
        admitted=[i % 2 == 0 for i in range(size)],
        sequence_kl=[i / 8 for i in range(size)],
        retained_tokens_mean=1.5,
        retained_tokens=[3.0 * i for i in range(size)],
    )
