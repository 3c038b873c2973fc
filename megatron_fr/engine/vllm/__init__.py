"""vLLM as an inference engine: its token-in/token-out wire (wire.py), its RL weight-update
routes, and how a server is started for the project (launch.py)."""
