"""Prompt files as a recipe names them: where the rows are and which fields hold what.

Read by envs/datasets.py (JSONL / JSON / Parquet rows -> samples); defined here so the run
config can type its task's files without importing anything that reads them.
"""

from __future__ import annotations

from pydantic import Field, PositiveInt

from megatron_fr.config.base import StrictModel


class DatasetConfig(StrictModel):
    """Where the prompts are and which fields of a row hold what."""

    path: str
    """A .jsonl, .json or .parquet file (parquet needs pyarrow)."""
    prompt_key: str | None = "problem"
    """The prompt: a string (-> "problem"), or a list of chat messages (-> "messages", and
    its last user message -> "problem"). None: the rows carry no prompt (game specs)."""
    label_key: str | None = "answer"
    """The reference answer (a string or a number) -> "answer". None: no label."""
    id_key: str = "id"
    """The row's id (a string or an integer) -> "id"; rows without one are numbered."""
    metadata_keys: dict[str, str] = Field(default_factory=dict)
    """More fields to lift into the sample: {sample field: dotted key in the row}."""
    records_key: str | None = None
    """.json only: the key holding the rows (a list of objects, or an object of objects)."""
    limit: PositiveInt | None = None
    """Keep the first `limit` rows."""
