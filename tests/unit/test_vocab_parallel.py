"""vocab_parallel_log_probs on one rank (the whole vocabulary) against torch.log_softmax.

The multi-rank (TP2) case is covered end to end by tests/distributed/test_parallel_loss.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_fr.parallel.vocab_parallel import vocab_parallel_log_probs


def _inputs(dtype=torch.float64, shape=(3, 5, 11), seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
    targets = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    return logits, targets


def test_log_probs_entropy_and_gradient_match_log_softmax():
    logits, targets = _inputs()
    ours = logits.clone().requires_grad_(True)
    theirs = logits.clone().requires_grad_(True)
    log_probs, entropy = vocab_parallel_log_probs(ours, targets, with_entropy=True)
    log_softmax = torch.log_softmax(theirs, -1)
    expected = log_softmax.gather(-1, targets[..., None])[..., 0]
    weights = torch.randn(expected.shape, dtype=torch.float64)
    (log_probs * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(log_probs, expected, rtol=0, atol=1e-12)
    expected_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    torch.testing.assert_close(entropy, expected_entropy.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=1e-12)
    assert not entropy.requires_grad


def test_caller_logits_are_not_modified():
    logits, targets = _inputs(torch.float32)
    before = logits.clone()
    log_probs, _ = vocab_parallel_log_probs(logits.requires_grad_(True), targets, with_entropy=True)
    log_probs.sum().backward()
    assert torch.equal(logits.detach(), before)


def test_bfloat16_logits_are_reduced_in_float32_and_gradient_keeps_their_dtype():
    logits, targets = _inputs(torch.bfloat16)
    leaf = logits.clone().requires_grad_(True)
    log_probs, _ = vocab_parallel_log_probs(leaf, targets)
    log_probs.sum().backward()
    expected = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
    assert log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs, expected, rtol=0, atol=1e-6)
    assert leaf.grad.dtype == torch.bfloat16


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1e4, 0.0, -1e4]], dtype=torch.float32, requires_grad=True)
    log_probs, entropy = vocab_parallel_log_probs(logits, torch.tensor([1]), with_entropy=True)
    assert log_probs.item() == pytest.approx(-1e4)
    assert torch.isfinite(entropy).all()


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (torch.zeros(3, 4, dtype=torch.long), "does not match logits"),
        (torch.zeros(3, 5), "integer token ids"),
        (torch.full((3, 5), 11), r"token ids in \[0, 11\)"),
        (torch.full((3, 5), -100), "set padding targets to 0"),
    ],
)
def test_bad_targets_are_refused(targets, message):
    logits, _ = _inputs()
    with pytest.raises(ValueError, match=message):
        vocab_parallel_log_probs(logits, targets)


@pytest.mark.gpu
def test_cuda_bfloat16_matches_cpu_float32():
    logits, targets = _inputs(torch.float32, shape=(4, 64, 1000))
    cpu, _ = vocab_parallel_log_probs(logits, targets, with_entropy=True)
    leaf = logits.to("cuda", torch.bfloat16).requires_grad_(True)
    gpu, entropy = vocab_parallel_log_probs(leaf, targets.cuda(), with_entropy=True)
    gpu.sum().backward()
    expected = torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, targets[..., None])
    torch.testing.assert_close(gpu.cpu(), expected[..., 0], rtol=0, atol=1e-5)
    assert (gpu.cpu() - cpu).abs().max() < 0.1  # bf16 rounding of the logits themselves
    assert leaf.grad.dtype == torch.bfloat16 and torch.isfinite(entropy).all()
