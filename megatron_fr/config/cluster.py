"""The cluster a recipe is laid out for: how many learner nodes its world spans and where its
inference servers run. `megatron-fr train --check` and `--rehearse`, `tools/plan_layout.py
--recipe` and the Slurm launcher (launch/slurm.py) read it from the recipe; their flags
override it."""

from __future__ import annotations

from pydantic import NonNegativeInt, PositiveInt

from megatron_fr.config.base import StrictModel


class ClusterSettings(StrictModel):
    """Nodes of the run. The learner's world is `learner_nodes` x `learner_ranks` (the ranks
    of each learner node): the world the layout (parallel.*), the memory verdicts and the
    rehearsal are for. A run started by hand on one machine has one learner node."""

    learner_nodes: PositiveInt = 1
    """Nodes of learner ranks, `learner_ranks` on each (one torchrun per node under Slurm)."""
    rollout_nodes: PositiveInt = 1
    """Nodes of inference servers when the Slurm launcher places them (nodes 1..R of the
    job; the learner nodes follow). A run on one machine starts rollout.engine.count
    engines itself and does not read it."""
    gpus_per_node: NonNegativeInt = 0
    """GPUs per node; 0: CPU nodes (the CPU engine and gloo learner ranks)."""
    server_gpus: PositiveInt | None = None
    """GPUs per inference server (its SGLang TP size); None: all of a node's GPUs."""

    @property
    def servers(self) -> int:
        """Inference servers on the rollout nodes: one per node without GPUs."""
        if not self.gpus_per_node:
            return self.rollout_nodes
        return self.rollout_nodes * (self.gpus_per_node // (self.server_gpus or self.gpus_per_node))
