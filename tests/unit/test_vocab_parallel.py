"""vocab_parallel_log_probs and the learner's chunked loss path on one rank (the whole
vocabulary) against torch.log_softmax, and the loss path's peak memory at Qwen3's vocabulary.

The multi-rank (TP2) case is covered end to end by tests/distributed/test_parallel_loss.py
(logits split over the vocabulary) and tests/distributed/test_learner.py (the loss path
through the model's output layer under TP2 + SP).
"""

from __future__ import annotations

import pytest
import torch

from megatron_fr.parallel.vocab_parallel import (
    chunk_tokens,
    chunked_vocab_parallel_log_probs,
    chunked_vocab_parallel_scores,
    loss_path_extra_memory,
    vocab_parallel_log_probs,
)
from megatron_fr.utils.tensor_memory import LiveTensorBytes


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
    torch.testing.assert_close(log_probs, expected, rtol=1e-6, atol=1e-6)
    assert leaf.grad.dtype == torch.bfloat16


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1e4, 0.0, -1e4]], dtype=torch.float32, requires_grad=True)
    log_probs, entropy = vocab_parallel_log_probs(logits, torch.tensor([1]), with_entropy=True)
    assert log_probs.item() == pytest.approx(-1e4)
    assert torch.isfinite(entropy).all()


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (torch.zeros(3, 4, dtype=torch.long), "does not match"),
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


def _hidden_inputs(dtype, tokens=37, hidden=8, vocab=13, seed=1):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.7).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    return h, w, targets


@pytest.mark.parametrize("chunk", [None, 5, 37, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_loss_path_equals_log_softmax_of_the_full_logits(chunk, temperature):
    """float32: log-probs, entropies and the gradients of the hidden states and the weight
    equal those of log_softmax(h @ W.T / T) built whole, to 1e-6 absolute plus 1e-6 relative
    (a few float32 rounding steps at |log p| of a few nats; the sum's order differs by
    chunk and by the machine's kernels); chunks of 5 tokens: several, with a short last
    one; None: the default, one chunk here)."""
    h, w, targets = _hidden_inputs(torch.float32)
    weights = torch.randn(targets.shape, generator=torch.Generator().manual_seed(2))
    mine = [h.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    log_probs, entropy = chunked_vocab_parallel_log_probs(
        *mine, targets, temperature=temperature, with_entropy=True, chunk=chunk
    )
    (log_probs * weights).sum().backward()
    ref = [h.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    log_softmax = torch.log_softmax(ref[0] @ ref[1].t() / temperature, -1)
    expected = log_softmax.gather(-1, targets[:, None])[:, 0]
    (expected * weights).sum().backward()
    torch.testing.assert_close(log_probs, expected, rtol=1e-6, atol=1e-6)
    expected_entropy = -(log_softmax.exp() * log_softmax).sum(-1).detach()
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(mine, ref, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-6)
    assert not entropy.requires_grad


def test_one_chunk_is_bit_identical_to_the_logits_path():
    """A micro-batch within one chunk (a small vocabulary) computes exactly what the model's
    output layer followed by vocab_parallel_log_probs did: the CPU demo's numbers do not
    move."""
    h, w, targets = _hidden_inputs(torch.float32)
    mine = [h.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    log_probs, _ = chunked_vocab_parallel_log_probs(*mine, targets)
    log_probs.sum().backward()
    ref = [h.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    expected, _ = vocab_parallel_log_probs(ref[0] @ ref[1].t(), targets)
    expected.sum().backward()
    assert torch.equal(log_probs, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, ref, strict=True))


def test_bfloat16_weights_score_in_float32_and_keep_their_gradient_dtype():
    h, w, targets = _hidden_inputs(torch.bfloat16)
    mine = [h.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    log_probs, _ = chunked_vocab_parallel_log_probs(*mine, targets, chunk=5)
    log_probs.sum().backward()
    expected = torch.log_softmax((h @ w.t()).float(), -1).gather(-1, targets[:, None])[:, 0]
    assert log_probs.dtype == torch.float32 and mine[1].grad.dtype == torch.bfloat16
    torch.testing.assert_close(log_probs, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("top_k", [0, 64])
def test_loss_path_peak_memory_is_under_a_quarter_of_the_full_fp32_logits(top_k):
    """At Qwen3's vocabulary (151,936) and 4,096 tokens: the most memory the loss path holds
    at once beyond its inputs and the gradients it returns, over the 2.5 GB the fp32 logits of
    the micro-batch would take (measured by counting live tensors); the same bound when it
    also scores the top-K gate's ids at the largest K."""
    vocab, tokens, hidden = 151_936, 4096, 16
    h, w, targets = _hidden_inputs(torch.float32, tokens, hidden, vocab)
    ids = torch.randint(0, vocab, (tokens, top_k)) if top_k else None
    assert chunk_tokens(vocab) < tokens
    assert 0 < loss_path_extra_memory(h, w, targets, ids) <= 0.25


@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_scores_of_more_ids_are_log_softmax_of_the_logits_and_change_nothing_else(
    chunk, temperature
):
    """The top-K gate's ids scored in the loss path: log_softmax(h @ W.T / T) at those ids
    (detached), while the targets' log-probs, entropies and gradients stay bit-identical to
    the path without ids."""
    h, w, targets = _hidden_inputs(torch.float64)
    ids = torch.stack(
        [
            torch.randperm(13, generator=torch.Generator().manual_seed(t))[:4]
            for t in range(targets.numel())
        ]
    ).to(torch.int32)
    mine = [h.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    log_probs, entropy, id_log_probs = chunked_vocab_parallel_scores(
        *mine, targets, temperature=temperature, with_entropy=True, ids=ids, chunk=chunk
    )
    log_probs.sum().backward()
    ref = [h.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    plain, plain_entropy = chunked_vocab_parallel_log_probs(
        *ref, targets, temperature=temperature, with_entropy=True, chunk=chunk
    )
    plain.sum().backward()
    assert torch.equal(log_probs, plain) and torch.equal(entropy, plain_entropy)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, ref, strict=True))
    expected = torch.log_softmax(h @ w.t() / temperature, -1).gather(-1, ids.long())
    torch.testing.assert_close(id_log_probs, expected, rtol=0, atol=1e-12)
    assert not id_log_probs.requires_grad
    with pytest.raises(ValueError, match=r"ids must be token ids in \[0, 13\)"):
        chunked_vocab_parallel_scores(h, w, targets, ids=ids + 13)


def test_live_tensor_bytes_counts_new_storage_once_and_frees_it():
    """What the memory figure rests on: a 4 MB tensor and a view of it count 4 MB; freed, 0;
    the input a view is taken of counts nothing; the peak stays."""
    outside = torch.zeros(1000, 1000)
    with LiveTensorBytes() as memory:
        made = outside + 1  # new: 4 MB
        view = made.t()  # a view: nothing more
        outside.t()  # a view of an input: nothing
        del made, view
        assert memory.live == 0
        kept = torch.ones(500, 1000)  # 2 MB
    assert memory.peak == 4_000_000 and memory.live == kept.nbytes


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(h=lambda h: h[:, :-1]), r"hidden \[N, H\] and weight"),
        (dict(targets=lambda t: t[:-1]), "does not match"),
        (dict(temperature=0.0), "temperature must be"),
    ],
)
def test_chunked_path_refuses_bad_inputs(change, message):
    h, w, targets = _hidden_inputs(torch.float32)
    args = dict(h=h, targets=targets, temperature=1.0)
    args.update({k: v(args[k]) if callable(v) else v for k, v in change.items()})
    with pytest.raises(ValueError, match=message):
        chunked_vocab_parallel_log_probs(
            args["h"], w, args["targets"], temperature=args["temperature"]
        )
