"""HF <-> megatron name and layout mapping, shared by the conversion tools and weight sync."""
