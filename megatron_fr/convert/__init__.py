"""HF checkpoints <-> megatron: the name and layout mapping (shared with weight sync), the
conversion tools, and the direct load / export every rank of a job runs on HF directories."""
