"""A model directory's chat format: its tokenizer's chat template, and where generation stops.

    chat = load_chat(model_dir)
    chat.prompt_ids(messages, tools)    # == tokenizer.apply_chat_template(messages, tools=tools,
                                        #        add_generation_prompt=True) token for token
    chat.stop_token_ids                 # <|im_end|>, then generation_config.json's eos_token_id
                                        # (an int or a list) and the tokenizer's EOS, deduplicated

The rendering is the agent loop's own (rollout.agent.ChatFormat), so a prompt the warm start
trains on, a prompt the RL loop sends and a prompt length checked by the dataset filter are the
same ids. A model's generation_config.json is where HF models say when to stop: Qwen2.5 / Qwen3
instruct models list <|im_end|> and <|endoftext|> there, while their tokenizer names only
<|im_end|> as EOS, so both sources are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_fr.rollout.agent import ChatFormat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

END_OF_TURN = ("<|im_end|>",)
"""The end-of-turn tokens ChatFormat looks for first (Qwen's)."""


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """eos_token_id of `model_dir`/generation_config.json as a tuple (() without the file or
    the key). An entry that is neither an int nor a list of ints is refused, naming the file."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    value = json.loads(path.read_text()).get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(token, int) and not isinstance(token, bool) for token in ids):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(ids)


def chat_format(
    tokenizer: PreTrainedTokenizerBase, extra_stop_ids: tuple[int, ...] = ()
) -> ChatFormat:
    """ChatFormat of `tokenizer` that also stops at `extra_stop_ids` (ids the vocabulary has)."""
    tokens = tokenizer.convert_ids_to_tokens(list(extra_stop_ids))
    unknown = [i for i, token in zip(extra_stop_ids, tokens, strict=True) if token is None]
    if unknown:
        raise ValueError(f"stop token ids {unknown} are outside the tokenizer's vocabulary")
    return ChatFormat(tokenizer, end_of_turn=(*END_OF_TURN, *tokens))


def load_chat(model_dir: str | Path) -> ChatFormat:
    """The chat format of an HF model directory (tokenizer files + generation_config.json)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        raise ValueError(f"{model_dir}: the tokenizer has no chat template")
    return chat_format(tokenizer, generation_eos_ids(model_dir))


__all__ = ["ChatFormat", "chat_format", "generation_eos_ids", "load_chat"]
