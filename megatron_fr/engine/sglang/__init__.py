"""SGLang as an inference engine: its wire format (protocol), its side of the engine interface
(wire) and the functions of its source the project reads without importing SGLang (source)."""
