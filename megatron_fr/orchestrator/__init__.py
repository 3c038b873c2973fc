"""The async controller and what it records in the run directory (metrics, batches, config,
checkpoints); what reads a run back (plots, reports, comparisons) is analysis/'s."""
