"""Between rollouts and the learner: the trajectory record and the bounded, lag-aware buffer."""
