"""Prompt files: JSONL / JSON / Parquet rows -> samples, field mapping, prompt-length filtering,
and the small datasets bundled in data/.

A sample is a dict (one row) with at least "id"; a row without one gets "<file stem>-<row>",
so ids are stable for a given file. Which other fields an environment reads is its own
business (math, python_tool: "problem", "answer"; alfworld: a game spec or "game_file").

Files laid out for other frameworks load by naming their fields (DatasetConfig), as slime's
--input-key / --label-key and verl's parquet files do:

    verl / the reference recipes:  {"prompt": [{"role": "user", "content": ...}],
                                    "reward_model": {"ground_truth": "34", "style": "rule"}}
    DatasetConfig(path=..., prompt_key="prompt", label_key="reward_model.ground_truth")
      -> {"id", "problem": <last user message>, "messages": <the prompt>, "answer": "34", ...}

A dotted key walks into nested objects. The row's own fields stay in the sample; the mapped
ones are added under the names the environments read. Bad input is refused whole, with the
file, the row and the field named.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megatron_fr.config.data import DatasetConfig
from megatron_fr.envs.base import Sample
from megatron_fr.utils.strict_json import DuplicateKeyError, loads_unique

DATA_DIR = Path(__file__).with_name("data")
BUNDLED: dict[str, tuple[str, ...]] = {
    "math": ("math.jsonl",),
    "python_tool": ("python_tool.jsonl",),
    "alfworld": ("alfworld.jsonl", "textworld.jsonl"),
}
"""Sample files shipped with the package, so recipes and tests run offline ("alfworld": the
hand-written real ALFWorld problems, then the TextWorld game specs)."""
ROLES = ("system", "user", "assistant", "tool")
MAX_ROW_CHARS = 4 * 2**20
"""Most characters one row may hold, as JSON (a line of a JSONL file): past that it is no
prompt any model here takes, and a tokenizer given 100 MB of text panics instead of
answering; the row is refused naming the file and the line first."""
MISSING = object()


def load_samples(
    path: str | Path, limit: int | None = None, records_key: str | None = None
) -> list[Sample]:
    """The rows of a prompt file as they are, each with an "id" (see DatasetConfig.path)."""
    return load_dataset(
        DatasetConfig(
            path=str(path), prompt_key=None, label_key=None, records_key=records_key, limit=limit
        )
    )


def load_dataset(config: DatasetConfig) -> list[Sample]:
    """The samples of `config.path` with the configured fields mapped (see the module doc)."""
    path = Path(config.path)
    rows = _read_rows(path, config.records_key)
    if not rows:
        raise ValueError(f"{path}: no rows")
    samples: list[Sample] = []
    seen: dict[str, tuple[str, object]] = {}  # id as text -> (where it first appeared, id)
    for where, row in rows[: config.limit]:
        if not isinstance(row, dict):
            raise ValueError(f"{path}: {where} is not an object")
        _check_text(row, f"{path}: {where}")
        sample = _map_row(row, config, f"{path}: {where}")
        if sample["id"] is None:  # absent, or a null in a parquet column
            sample["id"] = f"{path.stem}-{len(samples)}"
        key = str(sample["id"])  # ids become text (prompt ids): 1 and "1" are one id
        if key in seen:
            first, first_id = seen[key]
            written = "" if first_id == sample["id"] else f" as {first_id!r}"
            raise ValueError(
                f"{path}: {where}: duplicate id {sample['id']!r} (first at {first}{written})"
            )
        seen[key] = (where, sample["id"])
        samples.append(sample)
    return samples


def _check_text(row: dict, where: str) -> None:
    """At most MAX_ROW_CHARS, and text: JSON may escape half of a UTF-16 pair (\\ud800)
    alone; that is no text, and the tokenizer cannot take it."""
    try:
        text = json.dumps(row, ensure_ascii=False)
        _check_length(len(text), where)
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{where}: holds a lone surrogate (an unpaired \\ud800-\\udfff "
            "escape), which is not text"
        ) from None
    except ValueError as error:  # what json.dumps refuses of a parquet row (NaN is kept)
        raise ValueError(f"{where}: {error}") from None


def _read_rows(path: Path, records_key: str | None) -> list[tuple[str, Any]]:
    """(where, row) pairs: "line N" for JSON lines, "row N" (from 0) otherwise."""
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"{path}: expected a .jsonl or .parquet (or .json) prompt file")
    if not path.is_file():
        what = "not a regular file" if os.path.lexists(path) else "no such prompt file"
        raise FileNotFoundError(f"{path}: {what}")
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte order mark is no content
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None
    if path.suffix == ".json" or records_key is not None:
        try:
            whole = _parse(text, str(path))
        except DuplicateKeyError:
            raise
        except ValueError:
            whole = MISSING  # JSON lines under a .json name (as `datasets` writes them)
        if whole is not MISSING:
            return _records(path, whole, records_key)
    if records_key is not None:
        raise ValueError(f"{path}: records_key needs one JSON document, not JSON lines")
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            _check_length(len(line), f"{path}:{number}")
            rows.append((f"line {number}", _parse(line, f"{path}:{number}")))
    return rows


def _check_length(characters: int, where: str) -> None:
    if characters > MAX_ROW_CHARS:
        raise ValueError(
            f"{where}: a row of {characters:,} characters, past the {MAX_ROW_CHARS:,} one "
            "prompt row may hold (is it one row, or a file without line breaks?)"
        )


def _parse(text: str, where: str) -> Any:
    """One JSON document; ValueError naming `where` when it is not one, or is nested deeper
    than the json module can follow (it recurses once per level)."""
    try:
        return loads_unique(text)
    except RecursionError:
        raise ValueError(f"{where}: nested deeper than JSON can be read here") from None
    except DuplicateKeyError as error:
        raise DuplicateKeyError(f"{where}: {error}; keep one") from None
    except ValueError as error:
        raise ValueError(f"{where}: not JSON ({error})") from None


def _parquet_rows(path: Path) -> list[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{path}: not a readable parquet file ({error})") from None
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]


def _records(path: Path, document: Any, records_key: str | None) -> list[tuple[str, Any]]:
    if records_key is not None:
        document = _lookup(document, records_key)
        if document is MISSING:
            raise ValueError(f"{path}: no records under {records_key!r}")
    if isinstance(document, dict):  # an object of rows, keyed by name
        document = list(document.values())
    if not isinstance(document, list):
        raise ValueError(f"{path}: expected a list of rows (set records_key to where they are)")
    return [(f"row {i}", row) for i, row in enumerate(document)]


def _lookup(row: Any, dotted: str) -> Any:
    """row["a"]["b"] for "a.b"; MISSING where a step is absent."""
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def _field(row: dict, key: str, role: str, where: str) -> Any:
    value = _lookup(row, key)
    if value is MISSING:
        raise ValueError(f"{where}: no field {key!r} ({role})")
    return value


def _map_row(row: dict, config: DatasetConfig, where: str) -> Sample:
    sample = dict(row)
    raw_id = _lookup(row, config.id_key)
    if raw_id is not MISSING and raw_id is not None and not _is_id(raw_id):
        raise ValueError(f"{where}: field {config.id_key!r} (id) must be a string or an integer")
    sample["id"] = None if raw_id is MISSING else raw_id
    if config.prompt_key is not None:
        sample.update(_prompt(_field(row, config.prompt_key, "prompt_key", where), where))
    if config.label_key is not None:
        label = _field(row, config.label_key, "label_key", where)
        if isinstance(label, bool) or not isinstance(label, str | int | float):
            raise ValueError(
                f"{where}: field {config.label_key!r} (label_key) must be a string or a "
                f"number, got {type(label).__name__}"
            )
        sample["answer"] = label
    for name, key in config.metadata_keys.items():
        sample[name] = _field(row, key, f"metadata_keys[{name!r}]", where)
    return sample


def _is_id(value: Any) -> bool:
    return (isinstance(value, str) and bool(value)) or type(value) is int


def _prompt(value: Any, where: str) -> dict[str, Any]:
    """{"problem"} for a string prompt; {"messages", "problem"} for chat messages."""
    if isinstance(value, str) and value.strip():
        return {"problem": value}
    valid = isinstance(value, list) and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        for m in value
    )
    users = [m["content"] for m in value if m["role"] == "user"] if valid else []
    if not users:
        raise ValueError(
            f"{where}: the prompt must be a non-empty string or a list of chat messages "
            f"({{'role': one of {ROLES}, 'content': str}}) with a user message"
        )
    messages = [{"role": m["role"], "content": m["content"]} for m in value]
    return {"messages": messages, "problem": users[-1]}


def write_jsonl(path: str | Path, samples: list[Sample]) -> Path:
    """`samples` as a JSONL prompt file, one object per line, written whole or not at all."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "w", encoding="utf-8") as f:
            for sample in samples:
                f.write(json.dumps(sample, ensure_ascii=False) + "\n")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)
    return path


def bundled_samples(env_name: str) -> list[Sample]:
    """The small sample dataset shipped for environment `env_name`."""
    if env_name not in BUNDLED:
        raise ValueError(f"no bundled samples for {env_name!r}; have {sorted(BUNDLED)}")
    return [sample for name in BUNDLED[env_name] for sample in load_samples(DATA_DIR / name)]
