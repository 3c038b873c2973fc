"""The inference-engine boundary in one place: the one interface the project talks to an
engine through (wire: generate, version, pause/resume, cache), what a server says it is
(server_info), the load-balancing client, the server launcher, plain HTTP calls (http), the
weight-update process group (group) and the compact record of routed experts (routing). Its
three implementations each have a subpackage: sglang/ (SGLang's wire, read against its
source), vllm/ (vLLM's wire, launch flags and the gloo weight-transfer backend loaded into its
workers) and cpu/ (the project's CPU engine, which speaks SGLang's wire where there is no GPU).
Nothing here knows about buffers, learners or tasks."""
