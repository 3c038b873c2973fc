"""Rollout side: turning prompts into trajectories (the multi-turn agent loop and tool-call
parsing); the engines it talks to live in megatron_fr.engine."""
