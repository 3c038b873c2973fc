"""Offline fixtures for the agent tests: a Qwen-style chat tokenizer, a tiny random model that
the CPU engine serves with it, and a scripted engine behind the CPU engine's own HTTP server.

- `build_tokenizer()` / `chat_model_dir(dir)`: the package's chat tokenizer
  (tasks/chat_tokenizer.py: byte-level BPE, Qwen's special tokens and chat template) trained
  on the bundled datasets, and the package's tiny chat model (tasks/tiny_models.py: a random
  Qwen3-MoE of matching vocabulary) saved with it.
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

from megatron_fr.demo.chat_tokenizer import build_chat_tokenizer
from megatron_fr.demo.tiny_models import build_tiny_chat_model
from megatron_fr.engine.cpu.engine import Output, Sampling
from megatron_fr.engine.cpu.server import CpuServer
from megatron_fr.engine.cpu.weights import RequestError
from megatron_fr.envs.datasets import DATA_DIR

VOCAB_SIZE = 600


def _chats() -> list[list[dict[str, str]]]:
    """Every bundled sample line as a user turn, and a few typical assistant turns."""
    lines = [
        line for path in sorted(DATA_DIR.glob("*.jsonl")) for line in path.read_text().splitlines()
    ]
    replies = ["print(sum(range(10)))", "Action: go east", "The answer is \\boxed{42}."]
    return [[{"role": "user", "content": line}] for line in lines] + [
        [{"role": "assistant", "content": reply}] for reply in replies
    ]


def build_tokenizer():
    """The chat tokenizer trained on the bundled datasets (offline, deterministic)."""
    return build_chat_tokenizer(_chats(), VOCAB_SIZE)


def chat_model_dir(directory: str | Path, seed: int = 0) -> Path:
    """Save that tokenizer and a random tiny Qwen3-MoE of matching vocabulary into `directory`."""
    return build_tiny_chat_model(
        directory, _chats(), vocab_size=VOCAB_SIZE, seed=seed, max_position_embeddings=16384
    )


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
    context_length: int = 2**20
    dtype: str = "float32"

    @property
    def return_routed_experts(self) -> bool:
        return self.routed

    def generate(
        self,
        input_ids: list[int],
        sampling: Sampling,
        rid: str,
        routed_experts_start: int | None = None,
        top_logprobs: int = 0,
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
        if top_logprobs:
            output.top_logprobs = [
                scripted_top(token, lp, top_logprobs)
                for token, lp in zip(ids, logprobs, strict=True)
            ]
        return output

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Nothing runs between the scripted answers, so there is nothing to abort."""
        return 0


def scripted_routing(tokens: list[int]) -> list[list[list[int]]]:
    """ScriptedEngine's routed experts of positions holding `tokens`: [position][layer][k]."""
    return [[[(t + layer) % 4, (t + layer + 1) % 4] for layer in range(2)] for t in tokens]


def scripted_top(token: int, log_prob: float, k: int) -> tuple[list[float], list[int]]:
    """ScriptedEngine's top-k of an output token sampled with `log_prob`: the token itself,
    then tokens token + 1, token + 2, ... (mod the vocabulary) at log-probs -5, -6, ..."""
    ids = [(token + j) % VOCAB_SIZE for j in range(k)]
    return [log_prob] + [-4.0 - j for j in range(1, k)], ids


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
