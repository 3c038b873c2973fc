"""Offline fixtures for the agent tests: a Qwen-style chat tokenizer, a tiny random model that
the CPU engine serves with it, and a scripted engine behind the CPU engine's own HTTP server.

- `chat_model_dir(dir)`: a byte-level BPE tokenizer trained here on the bundled datasets (so
  it needs no download) with Qwen's special tokens and a Qwen2.5-style chat template (tools
  in the system turn, consecutive tool messages grouped into one user turn of
  <tool_response> blocks), saved next to a random Qwen3 model whose vocabulary matches it.
- `ScriptedEngine`: stands in for CpuEngine inside cpu_server.CpuServer. Its "model" is a
  policy function from the conversation text (the prompt ids decoded) to the next turn's
  text; the reply is that text's ids plus <|im_end|>, cut at max_new_tokens, with made-up
  log-probs that differ per token (so misaligned bookkeeping shows). The policy is scripted,
  not learned; the HTTP server, the wire format, the client and the agent loop are real.
- `serving(engine)`: CpuServer(engine) on a free 127.0.0.1 port for the duration.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aiohttp import web

from megatron_fr.engine.cpu_engine import Output, Sampling
from megatron_fr.engine.cpu_server import CpuServer
from megatron_fr.engine.cpu_weights import RequestError
from megatron_fr.envs.datasets import DATA_DIR

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
"""Added tokens like in Qwen2.5 (not "special": decoding keeps them)."""

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
"""Qwen2.5's chat template in structure (its exact text is not needed offline)."""


def _corpus() -> list[str]:
    lines = [CHAT_TEMPLATE]
    for path in sorted(DATA_DIR.glob("*.jsonl")):
        lines += path.read_text().splitlines()
    lines += ["print(sum(range(10)))", "Action: go east", "The answer is \\boxed{42}."]
    return lines


def build_tokenizer(vocab_size: int = 600):
    """A PreTrainedTokenizerFast with the chat template, trained offline in ~0.1 s."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer)
    backend.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TOOL_TAGS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def chat_model_dir(directory: str | Path, seed: int = 0) -> Path:
    """Save the tokenizer and a random Qwen3 of matching vocabulary into `directory`."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    directory = Path(directory)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(directory)
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=16384,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


Policy = Callable[[str], str]
"""Conversation so far (decoded prompt ids) -> the next assistant turn's text."""


@dataclass
class ScriptedEngine:
    """What CpuServer needs of an engine, with a scripted policy as the model."""

    tokenizer: object
    policy: Policy
    weight_version: str = "3"
    model_path: str = "scripted"
    outputs: list[list[int]] = field(default_factory=list)
    """Every output_ids returned, in order (to check the action mask against)."""
    inputs: list[list[int]] = field(default_factory=list)
    """The input_ids of every request, in the same order."""
    active_requests: int = 0
    running_requests: int = 0
    routed: bool = False
    """Act as a MoE with 2 layers, top-2 of 4 experts: routed_experts reports position p of a
    request, holding token t, in layer l as experts (t + l) % 4 and (t + l + 1) % 4."""

    def generate(
        self,
        input_ids: list[int],
        sampling: Sampling,
        rid: str,
        routed_experts_start: int | None = None,
    ) -> Output:
        if routed_experts_start is not None and not self.routed:
            raise RequestError("return_routed_experts: a scripted policy has no MoE router")
        conversation = self.tokenizer.decode(input_ids, skip_special_tokens=False)
        text = self.policy(conversation)
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        finish = {"type": "stop", "matched": ids[-1]}
        if len(ids) > sampling.max_new_tokens:
            ids = ids[: sampling.max_new_tokens]
            finish = {"type": "length", "length": sampling.max_new_tokens}
        self.inputs.append(list(input_ids))
        self.outputs.append(ids)
        logprobs = [-0.05 * (1 + i % 7) for i in range(len(ids))]
        output = Output(ids, logprobs, finish, self.weight_version, len(input_ids))
        if routed_experts_start is not None:
            fed = (list(input_ids) + ids[:-1])[routed_experts_start:]
            output.routed_experts = torch.tensor(scripted_routing(fed), dtype=torch.int32)
        return output

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Nothing runs between the scripted answers, so there is nothing to abort."""
        return 0


def scripted_routing(tokens: list[int]) -> list[list[list[int]]]:
    """ScriptedEngine's routed experts of positions holding `tokens`: [position][layer][k]."""
    return [[[(t + layer) % 4, (t + layer + 1) % 4] for layer in range(2)] for t in tokens]


@contextlib.asynccontextmanager
async def serving(engine: object) -> AsyncIterator[str]:
    """CpuServer(engine) on a free local port; yields its URL."""
    runner = web.AppRunner(CpuServer(engine, max_concurrency=4).app())
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def turn_count(conversation: str) -> int:
    """Assistant turns already in a conversation (the one being generated excluded)."""
    return conversation.count("<|im_start|>assistant") - 1
