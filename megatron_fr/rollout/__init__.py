"""Rollout side: SGLang's wire format, the load-balancing client and server launching."""
