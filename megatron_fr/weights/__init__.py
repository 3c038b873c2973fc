"""Learner weights -> inference engines: resharding into HF tensors, transports, the sync."""
