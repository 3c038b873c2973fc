"""The learner's model on megatron's local spec, on whatever device this machine has (CUDA
when present, as a GPU without transformer-engine runs it): every parameter on that device,
and a packed row (THD, two trajectories) giving each trajectory the log-probs it gets alone.
megatron's own DotProductAttention refuses packed rows; models/attention.py extends it."""

from __future__ import annotations

import torch

from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.demo.tiny_models import tiny_model_config
from megatron_fr.models.gpt import build_gpt_model, use_transformer_engine
from megatron_fr.models.hf_config import load_hf_config
from megatron_fr.parallel.state import initialize_single_process

LENGTHS = (7, 5)


def log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1)[:-1].gather(-1, tokens[1:, None])[:, 0]


def test_local_spec_model_is_on_the_device_and_a_packed_row_equals_its_trajectories_alone():
    from megatron.core.packed_seq_params import PackedSeqParams

    assert not use_transformer_engine(), "this test is for the local spec"
    initialize_single_process(ParallelConfig(), seed=0)
    spec = load_hf_config(tiny_model_config(vocab_size=64))
    model = build_gpt_model(
        spec, ParallelConfig(), params_dtype=torch.float32, spec_kind="local"
    ).eval()
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    for name, parameter in model.named_parameters():
        assert parameter.device == (device or torch.device("cpu")), name
    device = device or torch.device("cpu")

    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, spec.vocab_size, (n,), generator=generator) for n in LENGTHS]
    with torch.no_grad():
        alone = []
        for s in sequences:
            positions = torch.arange(len(s))[None].to(device)
            logits = model(s[None].to(device), positions, attention_mask=None)[0]
            alone.append(log_probs(logits, s.to(device)))
        cu = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32, device=device)
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu,
            max_seqlen_q=max(LENGTHS),
            max_seqlen_kv=max(LENGTHS),
        )
        row = torch.cat(sequences)[None].to(device)
        positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].to(device)
        logits = model(row, positions, attention_mask=None, packed_seq_params=packed)[0]
    starts = (0, LENGTHS[0])
    together = [
        log_probs(logits[start : start + n], s.to(device))
        for start, n, s in zip(starts, LENGTHS, sequences, strict=True)
    ]
    for mine, reference in zip(together, alone, strict=True):
        torch.testing.assert_close(mine, reference, rtol=0, atol=1e-4)
