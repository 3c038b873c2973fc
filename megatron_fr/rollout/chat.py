"""A model directory's chat format: its tokenizer's chat template, and where generation stops.

    chat = load_chat(model_dir)
    chat.prompt_ids(messages, tools)    # == tokenizer.apply_chat_template(messages, tools=tools,
                                        #        add_generation_prompt=True) token for token
    chat.stop_token_ids                 # <|im_end|>, then generation_config.json's eos_token_id
                                        # (an int or a list) and the tokenizer's EOS, deduplicated

ChatFormat is the agent loop's rendering (rollout/agent.py), so a prompt the demo's warm start
trains on, a prompt the RL loop sends and a prompt length checked by the dataset filter are the
same ids. A model's generation_config.json is where HF models say when to stop: Qwen2.5 / Qwen3
instruct models list <|im_end|> and <|endoftext|> there, while their tokenizer names only
<|im_end|> as EOS, so both sources are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_fr.envs.base import Environment, Message, Sample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PLACEHOLDER = "\u2063MEGATRON-FR-ASSISTANT-TURN\u2063"
"""Stands for an assistant turn's content when rendering the template around it."""


class ChatFormat:
    """A transformers tokenizer's chat template, as token ids the loop can splice."""

    def __init__(self, tokenizer: Any, end_of_turn: tuple[str, ...] = ("<|im_end|>",)) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        stops = [vocab[token] for token in end_of_turn if token in vocab]
        if tokenizer.eos_token_id is not None:
            stops.append(tokenizer.eos_token_id)
        if not stops:
            raise ValueError(f"the tokenizer has none of the end-of-turn tokens {end_of_turn}")
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))

    def render(self, messages: list[Message], tools: list[dict] | None, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation
        )

    def encode(self, text: str) -> list[int]:
        """Template text -> ids; special tokens written in the text map to their ids."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        return self.encode(self.render(messages, tools, generation=True))

    def turn_text(self, output_ids: list[int]) -> str:
        """What the policy said: its tokens decoded, without the end-of-turn token."""
        if output_ids and output_ids[-1] in self.stop_token_ids:
            output_ids = output_ids[:-1]
        return self.tokenizer.decode(
            output_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def between_turns_ids(
        self,
        history: list[Message],
        observations: list[Message],
        tools: list[dict] | None,
        last_token: int | None,
    ) -> list[int]:
        """Ids from the end of an assistant turn to the next generation prompt: the template's
        end of the turn (less the end-of-turn token if the policy generated it, `last_token`),
        the observation turns, and the generation prompt."""
        turn = {"role": "assistant", "content": PLACEHOLDER}
        text = self.render([*history, turn, *observations], tools, generation=True)
        tail = text[text.rindex(PLACEHOLDER) + len(PLACEHOLDER) :]
        if last_token in self.stop_token_ids:
            generated = self.tokenizer.decode([last_token], skip_special_tokens=False)
            if tail.startswith(generated):
                tail = tail[len(generated) :]
        return self.encode(tail)


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


def filter_by_prompt_length(
    samples: list[Sample], environment: Environment, chat: ChatFormat, max_prompt_tokens: int
) -> tuple[list[Sample], int]:
    """The samples whose opening prompt (the episode's messages and tools, rendered by the
    chat template with the generation prompt, as the agent loop sends it) has at most
    `max_prompt_tokens` ids, and how many were dropped. Starts each sample's episode, so an
    environment whose start is costly (a game) pays it once per sample here."""
    kept = []
    for sample in samples:
        episode = environment.start(sample)
        try:
            length = len(chat.prompt_ids(episode.messages, episode.tools))
        finally:
            episode.close()
        if length <= max_prompt_tokens:
            kept.append(sample)
    return kept, len(samples) - len(kept)
