"""The project's CPU engine: SGLang's wire served on transformers where there is no GPU (server:
the HTTP routes and process; engine: batching and sampling; requests: body limits and parsing;
wire: SGLang's answers; weights: in-place weight updates). serve_cli starts it."""
