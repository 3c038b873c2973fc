"""HF config -> megatron TransformerConfig / GPTModel for Qwen3-MoE, Qwen3 and Qwen2."""
