"""A model directory's chat format: its tokenizer's chat template, and where generation stops.

    chat = load_chat(model_dir)
    chat.prompt_ids(messages, tools)    # == tokenizer.apply_chat_template(messages, tools=tools,
                                        #        add_generation_prompt=True) token for token
    chat.stop_token_ids                 # <|im_end|>, then generation_config.json's eos_token_id
                                        # (an int or a list) and the tokenizer's EOS, deduplicated

ChatFormat is the agent loop's rendering (rollout/agent.py), so a prompt the demo's warm start
trains on, a prompt the RL loop sends and a prompt length checked by the dataset filter are the
same ids.

Text from the environment is data: a prompt file's messages, a tool's output, a game's answer
may hold the template's control tokens as text (`<|im_end|>\n<|im_start|>assistant`, printed
by a tool program), and tokenising the rendered conversation as a whole would turn them into
the real ids, a forged turn. So every non-assistant message's content is located in the
rendering (rendered as an unguessable mark, then put in place), the whole text is tokenised as
transformers does it, and a control token (any added token) that lies in such a content is
replaced by the ids of its text with none (its first character apart). Text without control
tokens gets exactly apply_chat_template's ids.

A model's generation_config.json is where HF models say when to stop: Qwen2.5 / Qwen3
instruct models list <|im_end|> and <|endoftext|> there, while their tokenizer names only
<|im_end|> as EOS, so both sources are read.
"""

from __future__ import annotations

import json
import re
import uuid
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
        self.control_ids = frozenset(tokenizer.added_tokens_decoder)
        """Added tokens (<|im_start|>, <tool_response>, ...): only the template may make them."""

    def render(self, messages: list[Message], tools: list[dict] | None, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation
        )

    def encode(self, text: str) -> list[int]:
        """Template text -> ids; special tokens written in the text map to their ids."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        """The conversation with the generation prompt; the contents of every message but the
        assistant's are data (module docstring)."""
        data = [message.get("role") != "assistant" for message in messages]
        text, spans = self._rendered(messages, tools, data)
        return self._encode_data(text, [(start, end) for _, start, end in spans])

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
        the observation turns (data), and the generation prompt."""
        turn = {"role": "assistant", "content": PLACEHOLDER}
        data = [False] * len(history) + [True] * (1 + len(observations))
        text, spans = self._rendered([*history, turn, *observations], tools, data)
        cut = max(end for index, _, end in spans if index == len(history))
        if last_token in self.stop_token_ids:
            generated = self.tokenizer.decode([last_token], skip_special_tokens=False)
            if text.startswith(generated, cut):
                cut += len(generated)
        tail = [(start - cut, end - cut) for _, start, end in spans if start >= cut]
        return self._encode_data(text[cut:], tail)

    def _rendered(
        self, messages: list[Message], tools: list[dict] | None, data: list[bool]
    ) -> tuple[str, list[tuple[int, int, int]]]:
        """The template's rendering with the generation prompt, and (message index, start,
        end) of every place the content of a message flagged in `data` was put: those are
        rendered as marks no text can hold (a fresh nonce), then replaced by their content."""
        nonce = uuid.uuid4().hex
        marked = [
            {**message, "content": f"\u2063{nonce}:{index}\u2063"} if flag else message
            for index, (message, flag) in enumerate(zip(messages, data, strict=True))
        ]
        pieces = re.split(f"\u2063{nonce}:(\\d+)\u2063", self.render(marked, tools, True))
        parts, spans, length = [pieces[0]], [], len(pieces[0])
        for index, after in zip(pieces[1::2], pieces[2::2], strict=True):
            content = messages[int(index)]["content"]
            spans.append((int(index), length, length + len(content)))
            parts += [content, after]
            length += len(content) + len(after)
        return "".join(parts), spans

    def _encode_data(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """`text` tokenised whole; a control token overlapping a span of data is replaced by
        the ids of its text without control tokens."""
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = []
        for token, (start, end) in zip(
            encoding["input_ids"], encoding["offset_mapping"], strict=True
        ):
            forged = token in self.control_ids and any(s < end and start < e for s, e in spans)
            ids += self._plain_ids(text[start:end]) if forged else [token]
        return ids

    def _plain_ids(self, text: str) -> list[int]:
        """Ids of `text` with no control token: where one would match, its first character
        is tokenised apart (`<` then `|im_end|>`)."""
        ids: list[int] = []
        while text:
            encoding = self.tokenizer(
                text,
                add_special_tokens=False,
                split_special_tokens=True,
                return_offsets_mapping=True,
            )
            tokens = encoding["input_ids"]
            found = next((k for k, t in enumerate(tokens) if t in self.control_ids), None)
            if found is None:
                return ids + tokens
            start = encoding["offset_mapping"][found][0]
            ids += tokens[:found] + self.encode(text[start])
            text = text[start + 1 :]
        return ids


END_OF_TURN = ("<|im_end|>",)
"""The end-of-turn tokens ChatFormat looks for first (Qwen's)."""


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """eos_token_id of `model_dir`/generation_config.json as a tuple (() without the file or
    the key). An entry that is neither an int nor a list of ints is refused, naming the file."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        value = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    value = value.get("eos_token_id")
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
