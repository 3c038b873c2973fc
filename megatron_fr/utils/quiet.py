"""Dependency messages a user cannot act on, kept off the console and in the run's log.

A run's console is for the run: its progress, what went wrong and how it ended. The learner
ranks' imports and set-up make megatron-core say things about itself that change nothing the
user controls (optional CUDA libraries this machine has no use for, its own API's deprecations
and experimental parts, a checkpoint save path it deprecates while calling it itself); on
the demo's 2 ranks they were most of the console. Each message here is matched by its exact
text (and its warning category, or the logger that logs it), never by module, category or
level: a new or changed message of the same library still reaches the console. What is kept
off the console is appended to RUN_DIR/logs/dependencies.log, a line each, with the process.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import TextIO

LOG_NAME = Path("logs") / "dependencies.log"
"""Where, under the run directory, the messages kept off the console go."""

_NO_APEX = "Transformer Engine and Apex are not installed. Falling back to "
KNOWN_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # optional CUDA libraries: megatron says at import which fallback it takes
    (UserWarning, "Apex is not installed. Falling back to Torch Norm"),
    (UserWarning, _NO_APEX + "Torch optimizers."),
    (
        UserWarning,
        _NO_APEX + "local implementations of multi_tensor_applier and multi_tensor_scale",
    ),
    (
        UserWarning,
        _NO_APEX + "local implementations of multi_tensor_applier, multi_tensor_l2norm, and "
        "multi_tensor_scale",
    ),
    # TransformerConfig's own default cuda_graph_modules ("full"; the run captures no graph)
    (
        UserWarning,
        "full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer.",
    ),
    # torch's, at a read of a non-leaf tensor's .grad during the learner's first step, raised
    # inside the CPU device mode (parallel/cpu_shims.py), which it names as the place
    (
        UserWarning,
        "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. "
        "Its .grad attribute won't be populated during autograd.backward(). If you "
        "indeed want the .grad field to be populated for a non-leaf Tensor, use "
        ".retain_grad() on the non-leaf Tensor. If you access the non-leaf Tensor by "
        "mistake, make sure you access the leaf Tensor instead. See "
        "github.com/pytorch/pytorch/pull/30531 for more information. (Triggered "
        "internally at /__w/pytorch/pytorch/build/aten/src/ATen/core/TensorBody.h:493.)",
    ),
    # megatron.core imports its multimodal config, which warns at class definition
    (
        UserWarning,
        "MimoModelConfig is experimental and still under active development. The API may change "
        "without notice in future releases.",
    ),
)
"""(category, exact text) of the warnings kept off the console."""

KNOWN_LOG_RECORDS: tuple[tuple[str, str], ...] = (
    (  # docs/development.md, "GPTModel's deprecation": what moving would cost, and when
        "megatron.core.models.gpt.gpt_model",
        "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new features. "
        "Please reference the migration guide `docs/"  # megatron's docs, not this project's
        "user-guide/hybrid-model-migration.md` for "
        "details on how to use `HybridModel`",
    ),
    (  # DDP computes the layout the distributed optimizer would, as megatron's own callers do
        "megatron.core.distributed.distributed_data_parallel",
        "DistributedDataParallel: full_param_layout not provided with "
        "use_distributed_optimizer=True. Auto-computing layout inside DDP. Callers should "
        "pre-compute layouts via DistributedOptimizer.compute_full_param_layout() and pass "
        "them in.",
    ),
    (  # megatron's synchronous save goes through this path itself (TorchDistSaveShardedStrategy)
        "megatron.core.dist_checkpointing.strategies.torch",
        "MCore's async save is deprecated and will be removed in the future releases. Please, "
        "use NVRx async solution by setting `async_strategy` to `nvrx`.",
    ),
)
"""(logger name, exact text) of the log records kept off the console."""


class _Quieted:
    """Appends the messages kept off the console to one file, opened at the first one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO | None = None

    def write(self, source: str, text: str) -> bool:
        """Whether the message is in the log. A log that cannot be written (the run directory
        unusable, the disk full) leaves the message to the console: a filter never raises into
        the code that logged, and nothing is lost."""
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            self._file.write(f"{stamp} pid {os.getpid()} {source}: {text}\n")
            self._file.flush()
        except OSError:
            return False
        return True


class _KnownRecords(logging.Filter):
    def __init__(self, quieted: _Quieted, messages: frozenset[str]) -> None:
        super().__init__()
        self.quieted, self.messages = quieted, messages

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text not in self.messages:
            return True
        return not self.quieted.write(f"{record.name} {record.levelname}", text)


_installed: _Quieted | None = None


def quiet_known_messages(run_dir: str | Path) -> Path:
    """Keep KNOWN_WARNINGS and KNOWN_LOG_RECORDS off the console from now on in this process,
    appended to RUN_DIR/logs/dependencies.log instead; any other warning or record is shown
    as before. Installed once per process (a second call changes nothing); returns the log."""
    global _installed
    if _installed is not None:
        return _installed.path
    quieted = _installed = _Quieted(Path(run_dir) / LOG_NAME)
    known = frozenset((category, text) for category, text in KNOWN_WARNINGS)
    show = warnings.showwarning

    def showwarning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        logged = (category, str(message)) in known and quieted.write(
            f"{category.__name__} {filename}:{lineno}", str(message)
        )
        if not logged:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    by_logger: dict[str, set[str]] = {}
    for name, text in KNOWN_LOG_RECORDS:
        by_logger.setdefault(name, set()).add(text)
    for name, texts in by_logger.items():
        logging.getLogger(name).addFilter(_KnownRecords(quieted, frozenset(texts)))
    return quieted.path
