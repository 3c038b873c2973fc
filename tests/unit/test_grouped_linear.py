"""The torch spec's grouped expert linear (models/torch_spec.py) against one matmul per expert,
written out: outputs and the gradients of the tokens and of every expert's weight, with
uneven and empty token groups, through torch's grouped_mm and through the per-expert fallback
(a torch or device without grouped_mm for the dtype). The whole spec against the local one:
tests/distributed/test_torch_spec.py."""

from __future__ import annotations

import pytest
import torch

from megatron_fr.models import torch_spec

COUNTS = [3, 0, 7, 5, 1]


def reference(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    rows, start = [], 0
    for count, weight in zip(COUNTS, weights, strict=True):
        rows.append(x[start : start + count] @ weight.t())
        start += count
    return torch.cat(rows)


@pytest.mark.parametrize("kernel", [True, False], ids=["grouped_mm", "per-expert"])
def test_grouped_linear_equals_one_matmul_per_expert(kernel, monkeypatch):
    if not kernel:
        monkeypatch.setattr(torch.nn.functional, "grouped_mm", None, raising=False)
        monkeypatch.setattr(torch, "_grouped_mm", None, raising=False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(sum(COUNTS), 16, generator=generator)
    weights = [torch.randn(12, 16, generator=generator) for _ in COUNTS]
    grad = torch.randn(sum(COUNTS), 12, generator=generator)
    mine = [x.clone().requires_grad_(True), *(w.clone().requires_grad_(True) for w in weights)]
    theirs = [x.clone().requires_grad_(True), *(w.clone().requires_grad_(True) for w in weights)]
    output = torch_spec._GroupedLinearFunction.apply(mine[0], COUNTS, *mine[1:])
    expected = reference(theirs[0], theirs[1:])
    output.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-5)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5)
    assert mine[2].grad.abs().max() == 0, "the expert with no tokens gets no gradient"


def test_padded_rows_place_every_group_on_an_aligned_start():
    padded = [8, 0, 8, 8, 8]
    rows = torch_spec._padded_rows(COUNTS, padded, "cpu").tolist()
    assert rows == [0, 1, 2, 8, 9, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 24]
