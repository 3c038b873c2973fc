"""Small helpers shared by the unit tests (imported as `helpers`: pytest puts this folder on
sys.path)."""

from __future__ import annotations

import torch


def log_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """log(sigmoid(x)): a log-probability in (-inf, 0). Written as -softplus(-x) because
    torch's logsigmoid takes milliseconds per call on small CPU tensors (its parallel path)."""
    return -torch.nn.functional.softplus(-x)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-12) -> None:
    """Same shape and dtype, |actual - expected| <= atol everywhere (NaN fails).

    Written out because torch.testing.assert_close spends seconds importing on first use."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert torch.allclose(actual, expected, rtol=0, atol=atol), (actual - expected).abs().max()


def random_policy_mask(
    gen: torch.Generator, batch: int, length: int, density: float = 0.7
) -> torch.Tensor:
    """A bool [batch, length] action mask with gaps and at least one policy token per row."""
    mask = torch.rand(batch, length, generator=gen) < density
    mask[torch.arange(batch), torch.randint(0, length, (batch,), generator=gen)] = True
    return mask
