"""The learner's model output: log-probs (and entropies) of given target tokens, made straight
from the final hidden states, so that the logits of a micro-batch are never held whole.

megatron's GPTModel hands its final hidden states and output layer to an ``output_processor``
when the forward is given one (megatron 0.19: GPTModel._postprocess) instead of applying the
output layer. TargetScores is such a processor: it brings the hidden states to what the
output layer would have multiplied (the whole sequence under sequence parallelism, gathered
over the TP group as ColumnParallelLinear does; the TP-parallel region otherwise, whose
backward sums the hidden states' gradient over the TP ranks' vocab shards) and scores the
targets with parallel/vocab_parallel.py's chunked loss path, at the rollout temperature.

The model's forward then returns [2 + K, rows, width]: row 0 the log-probs of the targets
(with their gradient), row 1 the entropies (detached; zeros unless asked for), rows 2 .. K + 1
the log-probs of K more ids per position when asked for (detached: the top-K gate scores the
engine's top-K tokens with them, made in the same chunks, so no logits are held). Tokens keep
megatron's [sequence, batch] order inside, so the output layer's gradient is accumulated in
the order megatron's own output layer would use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megatron_fr.parallel.vocab_parallel import chunked_vocab_parallel_scores

if TYPE_CHECKING:
    from megatron.core.tensor_parallel import ColumnParallelLinear


@dataclass(frozen=True)
class TargetScores:
    """An output_processor for GPTModel.forward: the scores of `targets` (module doc)."""

    targets: Tensor
    """[rows, width] the token each position predicts (this rank's CP slice of the rows)."""
    temperature: float = 1.0
    """The rollouts' sampling temperature: log softmax(logits / temperature) is scored."""
    with_entropy: bool = False
    """Also the entropies of the full categorical (the negative-token filter needs them)."""
    ids: Tensor | None = None
    """[rows, width, K] more token ids to score at each position (the top-K gate's); None."""

    def __call__(
        self,
        *,
        hidden_states: Tensor,
        output_layer: ColumnParallelLinear,
        output_weight: Tensor | None = None,
        **_unused: object,
    ) -> Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        group = output_layer.tp_group
        if output_layer.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, True, group=group)
        elif group.size() > 1:
            hidden_states = copy_to_tensor_model_parallel_region(hidden_states, group=group)
        weight = output_layer.weight if output_weight is None else output_weight
        sequence, rows, _ = hidden_states.shape
        ids = None if self.ids is None else self.ids.transpose(0, 1).reshape(sequence * rows, -1)
        log_probs, entropy, id_log_probs = chunked_vocab_parallel_scores(
            hidden_states.reshape(sequence * rows, -1),
            weight,
            self.targets.t().reshape(-1),
            group,
            temperature=self.temperature,
            with_entropy=self.with_entropy,
            ids=ids,
        )
        if entropy is None:
            entropy = torch.zeros_like(log_probs)
        scores = torch.stack([log_probs, entropy])
        if id_log_probs is not None:
            scores = torch.cat([scores, id_log_probs.t()])
        return scores.view(-1, sequence, rows).transpose(1, 2)
