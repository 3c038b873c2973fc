"""vLLM as an inference engine: its token-in/token-out wire and side of the engine interface
(wire.py), how a server is started for the project (launch.py), the gloo weight-transfer
backend loaded into its workers (gloo_transfer.py) and a one-off push (push.py)."""
