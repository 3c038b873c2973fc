"""The SGLang boundary in one place: SGLang's wire format (protocol), the load-balancing
client, the server launcher, the weight-update HTTP calls (http) and process-group setup
(group), the compact record of SGLang's routed experts (routing), the SGLang-protocol CPU
engine that stands in for SGLang where there is no GPU (cpu_engine, cpu_server, serve_cli), and
vLLM's wire, launch flags and weight push (vllm/: not yet an engine kind of a run).
Nothing here knows about buffers, learners or tasks."""
