"""The megatron learner: model build, forward-backward with the parallel loss, optimizer step."""
