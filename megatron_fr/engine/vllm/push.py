"""The learner's end of one weight push into a vLLM server, through vLLM's RL weight-update
protocol and the project's gloo backend (gloo_transfer.py, in vLLM's workers): the group is
hosted here (engine/group.py, as for SGLang), the server joins it through
/init_weight_transfer_engine, /start_weight_update opens vLLM's layerwise reload,
/update_weights names the tensors while this end broadcasts each, /finish_weight_update closes
the reload and sets the version, and /shutdown_weight_transfer_engine releases the group.

vLLM answers /init_weight_transfer_engine and /update_weights only once the collective on its
side is done, so those two calls run on a thread while this end joins or sends. This is one
full-tensor push to one single-rank server (rank_offset 1, world size 2), what the CPU tier
tests; the run's bucketed, resharded sync to a pool is weights/sync.py's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from megatron_fr.engine.group import create_weight_update_group
from megatron_fr.engine.http import post_json
from megatron_fr.engine.vllm import wire


def push_tensors(
    url: str,
    tensors: Sequence[tuple[str, torch.Tensor]],
    version: str,
    master_address: str,
    master_port: int,
    group_name: str,
    timeout_s: float = 300.0,
) -> None:
    """Push `tensors` (HF names, full tensors) into the server at `url` and label its weights
    `version` (module docstring). Raises the server's error, or the group's."""
    init = wire.init_transfer_request(master_address, master_port, 1, 2, group_name, timeout_s)
    joining = _in_background(lambda: post_json(url, wire.INIT_TRANSFER_PATH, init, timeout_s))
    group = create_weight_update_group(
        master_address, master_port, 2, group_name, timeout_s=timeout_s
    )
    try:
        joining()
        post_json(url, wire.START_UPDATE_PATH, {}, timeout_s)
        update = wire.update_weights_request(
            [name for name, _ in tensors],
            [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            [list(t.shape) for _, t in tensors],
        )
        receiving = _in_background(
            lambda: post_json(url, wire.UPDATE_WEIGHTS_PATH, update, timeout_s)
        )
        for _, tensor in tensors:
            group.broadcast(tensor.detach().contiguous())
        receiving()
        post_json(url, wire.FINISH_UPDATE_PATH, {"weight_version": version}, timeout_s)
        post_json(url, wire.SHUTDOWN_TRANSFER_PATH, {}, timeout_s)  # the peer leaves first
    finally:
        group.destroy()


def _in_background(call: Callable[[], object]) -> Callable[[], None]:
    """Start `call` on a thread; the returned function waits for it and raises what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as error:  # handed to the waiting caller
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if errors:
            raise errors[0]

    return wait
