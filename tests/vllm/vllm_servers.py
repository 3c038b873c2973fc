"""Starting a real vLLM server for the tier's tests, and the tiny models they serve."""

from __future__ import annotations

from pathlib import Path

from megatron_fr.engine.launcher import (
    ServerExited,
    ServerLaunchConfig,
    ServerProcess,
    launch_server,
)
from megatron_fr.utils.net import free_port

TINY_QWEN3 = dict(  # vLLM's CPU attention takes head_dim 32, 64, 80, ... (not 16)
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=4096,  # long requests: a pause must catch them in flight
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
)
PROMPT = [5, 17, 42, 9]
SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "4096", "--max-num-seqs", "16")
TINY_QWEN3_MOE = dict(
    TINY_QWEN3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
)


def start_vllm(model_dir: Path, log_dir: Path, attempts: int = 3) -> ServerProcess:
    """The server, healthy; started again on another port when the one picked was taken in
    the seconds vLLM spends importing before it binds (other tests pick ports too)."""
    for attempt in range(attempts):
        config = ServerLaunchConfig(
            model_path=str(model_dir),
            port=free_port(),
            log_dir=log_dir,
            engine="vllm",
            skip_tokenizer_init=True,
            extra_args=SERVER_ARGS,
        )
        server = launch_server(config)
        try:
            server.wait_healthy(deadline_s=900)
            return server
        except ServerExited as error:
            server.stop()
            if "Address already in use" not in str(error) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
