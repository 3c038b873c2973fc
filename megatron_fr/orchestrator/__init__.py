"""The async controller and what it records in the run directory (metrics, config, plots)."""
