"""Shared pieces of the CPU engine tests: the engine served over real TCP (as `cpu_server.main`
serves it), a gate on the model's forward calls, and transformers references.

- `serving(engine)`: CpuServer on a free port with aiohttp's production runner (handlers are
  not cancelled when a client disconnects, as under web.run_app); yields (url, server).
- `StepGate`: a forward pre-hook counting the decoding steps (one forward per generated token),
  recording which checkpoint the live weights equal at each step ("a", "b", ... or "mixed"),
  and able to hold the decoding thread inside a chosen step until the test lets it go.
- `full_sequence_log_probs` / `carried_cache_log_probs`: what transformers' own model gives for
  each output token, by one forward over the whole sequence, or step by step with the KV cache
  carried across a switch of weights (what an in-place update does to a running request).
- `router_top_k`: the experts transformers' own MoE routers pick for each position of a
  sequence, from one forward over it.
- `until(condition, what)`: wait (asynchronously) until a condition on the engine holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import torch
from aiohttp import web

from megatron_fr.engine.cpu.engine import CpuEngine
from megatron_fr.engine.cpu.server import AUTO_DECOMPRESS, CpuServer

PROMPT = [3, 17, 42, 5]
HOLD_TIMEOUT_S = 120.0
"""Hang guard only: how long a held or awaited step may take before the test fails."""


@contextlib.asynccontextmanager
async def serving(engine: CpuEngine, **server_kwargs) -> AsyncIterator[tuple[str, CpuServer]]:
    server = CpuServer(engine, **server_kwargs)
    runner = web.AppRunner(server.app(), auto_decompress=AUTO_DECOMPRESS)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", server
    finally:
        await runner.cleanup()


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + HOLD_TIMEOUT_S  # hang guard only
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class StepGate:
    """Counts and fingerprints the engine's decoding steps; holds the thread at `stop_at`."""

    def __init__(self, engine: CpuEngine, checkpoints: dict[str, Path]):
        self.calls = 0
        self.seen: list[str] = []
        """The checkpoint the live weights equalled at each forward call, in order."""
        self._params = dict(engine.model.named_parameters())
        self._known = {
            label: dict(hf_model(path).named_parameters()) for label, path in checkpoints.items()
        }
        self._stop_at: int | None = None
        self._held, self._go = threading.Event(), threading.Event()
        engine.model.register_forward_pre_hook(self._hook)

    def identify(self) -> str:
        """Which checkpoint every live parameter equals, or "mixed"."""
        labels = set()
        for name, live in self._params.items():
            match = [
                label for label, known in self._known.items() if torch.equal(known[name], live)
            ]
            labels.add(match[0] if len(match) == 1 else "mixed")
        return labels.pop() if len(labels) == 1 else "mixed"

    def _hook(self, _module, _args) -> None:
        self.calls += 1
        self.seen.append(self.identify())
        if self.calls == self._stop_at:
            self._held.set()
            assert self._go.wait(HOLD_TIMEOUT_S), "the test never let the step go"
            self._go.clear()

    def hold_at(self, call: int) -> None:
        """Hold the decoding thread inside forward call number `call` (set it beforehand)."""
        self._stop_at = call

    async def held(self) -> None:
        """Wait until the decoding thread is held."""
        assert await asyncio.to_thread(self._held.wait, HOLD_TIMEOUT_S), "step never reached"
        self._held.clear()

    def go(self, next_hold: int | None = None) -> None:
        """Let the held step finish; hold again at call `next_hold`."""
        self._stop_at = next_hold
        self._go.set()


def _row_log_probs(logits: torch.Tensor, tokens: list[int], temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[
        :, 0
    ]


def full_sequence_log_probs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / T) of every output token, from one forward over prompt + tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return _row_log_probs(logits[len(prompt) - 1 : -1], tokens, temperature)


def router_top_k(model: torch.nn.Module, tokens: list[int], top_k: int) -> np.ndarray:
    """[positions, layers, top_k] expert ids, sorted: the top-k of the router logits
    transformers returns for one forward over `tokens` (output_router_logits)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
    top = torch.stack([layer.topk(top_k, dim=-1).indices for layer in logits], dim=1)
    return np.sort(top.numpy(), axis=-1)


def carried_cache_log_probs(
    models: list[torch.nn.Module], prompt: list[int], tokens: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Token i scored by models[i] step by step, with the KV cache of earlier positions kept
    from the models that encoded them (an in-place update keeps a running request's cache)."""
    cache, feed, rows = None, prompt, []
    name = (
        "cache" if "cache" in inspect.signature(models[0].forward).parameters else "past_key_values"
    )
    with torch.no_grad():
        for model, token in zip(models, tokens, strict=True):
            out = model(input_ids=torch.tensor([feed]), use_cache=True, **{name: cache})
            cache, feed = getattr(out, name), [token]
            rows.append(out.logits[0, -1])
    return _row_log_probs(torch.stack(rows), tokens, temperature)
