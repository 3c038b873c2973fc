"""A Qwen-style chat tokenizer trained here, on the text it will encode, for the CPU recipes.

No tokenizer can be downloaded where the CPU recipes and the tests run, so the project trains
its own with the `tokenizers` library, deterministically, in a fraction of a second. It is
built the way Qwen2.5 / Qwen3 tokenizers are, so the code that serves it (the agent loop's
chat template, stop tokens, the CPU engine) is the code that serves the real ones:

- byte-level BPE behind Qwen's pre-tokenizer split, which isolates every digit (`\\p{N}`): a
  number is one token per digit, so "23 + 45" is learnable digit by digit, and no merge can
  glue a digit to the text around it;
- the special tokens <|endoftext|> (padding), <|im_start|>, <|im_end|> (end of turn and the
  tokenizer's EOS), and the tool tags as added, non-special tokens (decoding keeps them);
- CHAT_TEMPLATE: Qwen2.5's chat template in structure (tools listed in the system turn,
  consecutive tool messages grouped into one user turn of <tool_response> blocks).

    tokenizer = build_chat_tokenizer(chats)          # chats: the conversations it will encode
    tokenizer.save_pretrained(directory)             # tokenizer.json + tokenizer_config.json
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN, START_OF_TURN, END_OF_TURN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, START_OF_TURN, END_OF_TURN)
"""Ids 0, 1, 2 of every tokenizer built here, in this order."""
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Added tokens as in Qwen2.5 (not "special": decoding keeps them)."""
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""The pre-tokenizer pattern of Qwen2 / Qwen2.5 / Qwen3's tokenizer.json (digits one each)."""
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
"""The byte alphabet and the special tokens: any text can be encoded from there on."""

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
"""Qwen2.5's chat template in structure (its exact wording is not needed offline)."""


def build_chat_tokenizer(
    chats: Iterable[list[dict[str, Any]]], vocab_size: int = 512
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with at most `vocab_size` entries (the tool tags come on
    top), trained on `chats` as CHAT_TEMPLATE renders them, with that template set.

    The merges are learnt on the rendered text (the role names, the scaffolding and the
    contents), so what the template writes around every turn costs a few tokens. Special
    tokens are cut out of the training text: they are single tokens already. Deterministic:
    the same chats give the same vocabulary. Text the chats never contain still encodes,
    byte by byte.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, trainers
    from tokenizers import pre_tokenizers as pre
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (bytes + specials)")
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_training_text(chats), trainer)
    backend.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TOOL_TAGS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=END_OF_TURN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[START_OF_TURN, END_OF_TURN],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _training_text(chats: Iterable[list[dict[str, Any]]]) -> Iterable[str]:
    """Each chat rendered by CHAT_TEMPLATE (jinja2, as transformers renders it), specials cut."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        CHAT_TEMPLATE
    )
    for messages in chats:
        text = template.render(messages=messages, tools=None, add_generation_prompt=False)
        for special in SPECIAL_TOKENS:
            text = text.replace(special, "\n")
        yield text
