"""Fuzz of the prompt files a recipe names (task.train and the held-out sets), checked through
`megatron-fr train --check`: seeded rows with one field of a bad type or value, files broken as
a whole (encoding, nesting, numbers, ids, types of file), and good files in the forms the loader
accepts. Every bad one must be refused naming the file (and row and field where there is one),
never a traceback, a hang or silent acceptance (tests/fuzz/fuzz_harness.py)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from fuzz_harness import Case, assert_sound, report, run_case

SEED = 31
ROWS = 5
BAD_FIELDS = {
    "problem": [
        7,
        None,
        [],
        {},
        "",
        "   ",
        [{"role": "robot", "content": "x"}],
        [{"role": "system", "content": "no user"}],
        [{"role": "user"}],
        True,
    ],
    "answer": [None, {}, [], True, [1, 2]],
    "id": [1.5, True, [], {}, ""],
}
"""A value each field must refuse (all drawn, some twice, in a seeded order)."""


def row(index: int) -> dict:
    return {"id": f"q{index}", "problem": f"What is {index} + 2?", "answer": str(index + 2)}


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def checked(ws: Path, file: Path, names: str | None, where: str = "train", *more: str) -> Case:
    key = "task.train" if where == "train" else "task.eval_sets.heldout"
    argv = ["train", str(ws / "recipe.yaml"), "--check", f"{key}.path={file}", *more]
    return Case(f"{where} {file.name}", argv, names)


def row_cases(ws: Path, rng: random.Random) -> list[Case]:
    """A file of good rows, one of them with one bad field."""
    cases = []
    draws = [(f, v) for f, values in BAD_FIELDS.items() for v in values]
    draws += rng.sample(draws, 10)
    for number, (field, value) in enumerate(draws):
        rows = [row(i) for i in range(ROWS)]
        rows[rng.randrange(ROWS)][field] = value
        path = write_rows(ws / f"row_{number}_{field}.jsonl", rows)
        cases.append(checked(ws, path, path.name, rng.choice(["train", "train", "eval"])))
    return cases


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def file_cases(ws: Path) -> list[Case]:
    good = "".join(json.dumps(row(i)) + "\n" for i in range(ROWS))
    texts = {
        "empty.jsonl": (b"", "no rows"),
        "blank.jsonl": (b"\n  \n\t\n", "no rows"),
        "not_json.jsonl": (good.encode() + b"{oops\n", "not_json.jsonl:6"),
        "deep_line.jsonl": (good.encode() + deep(100_000).encode() + b"\n", "deep_line.jsonl"),
        "deep_field.jsonl": (
            good.encode()
            + json.dumps(row(9))[:-1].encode()
            + b', "meta": '
            + deep(5_000).encode()
            + b"}\n",
            "deep_field.jsonl",
        ),
        "a_list.jsonl": (good.encode() + b"[1, 2]\n", "not an object"),
        "a_number.jsonl": (b"42\n" + good.encode(), "not an object"),
        "latin1.jsonl": (
            good.encode() + '{"id": "é", "problem": "ça?", "answer": "1"}\n'.encode("latin-1"),
            "latin1.jsonl",
        ),
        "nul.jsonl": (good.encode() + b"\x00\x00\n", "nul.jsonl"),
        "huge_number.jsonl": (
            good.encode() + b'{"id": "n", "problem": "p", "answer": ' + b"9" * 5000 + b"}\n",
            "huge_number.jsonl",
        ),
        "surrogate.jsonl": (
            good.encode() + b'{"id": "s", "problem": "\\ud800?", "answer": "1"}\n',
            "surrogate.jsonl",
        ),
        "dup_ids.jsonl": ((good + json.dumps(row(0)) + "\n").encode(), "duplicate id"),
        "int_and_text_ids.jsonl": (
            (
                json.dumps(row(0) | {"id": 1}) + "\n" + json.dumps(row(1) | {"id": "1"}) + "\n"
            ).encode(),
            "duplicate id",
        ),
        "prompts.csv": (b"id,problem,answer\n1,x,2\n", "prompts.csv"),
        "garbage.parquet": (os.urandom(64), "garbage.parquet"),
        "scalars.json": (json.dumps({"a": 1, "b": 2}).encode(), "not an object"),
        "deep.json": (deep(100_000).encode(), "deep.json"),
        "truncated.json": (
            json.dumps([row(i) for i in range(ROWS)])[:-7].encode(),
            "truncated.json",
        ),
        "bom_bad.jsonl": (b"\xef\xbb\xbf" + b"{oops\n", "bom_bad.jsonl"),
        "dup_key.jsonl": (
            good.encode() + b'{"id": "d", "problem": "p", "answer": "1", "answer": "2"}\n',
            "dup_key.jsonl:6",
        ),
        "dup_nested_key.jsonl": (
            good.encode() + b'{"id": "d", "problem": "p", "answer": "1", "m": {"a": 1, "a": 2}}\n',
            "dup_nested_key.jsonl:6",
        ),
        "dup_key.json": (
            b'[{"id": "d", "id": "e", "problem": "p", "answer": "1"}]',
            "dup_key.json",
        ),
        "long_row.json": (
            json.dumps([row(0) | {"problem": "1 + " * 2**21}]).encode(),
            "long_row.json",
        ),
    }
    cases = []
    for name, (data, names) in texts.items():
        (ws / name).write_bytes(data)
        cases += [checked(ws, ws / name, names), checked(ws, ws / name, names, "eval")]
    records = ws / "records.json"
    records.write_text(json.dumps({"rows": [row(i) for i in range(ROWS)]}))
    cases.append(checked(ws, records, "nope", "train", "task.train.records_key=nope"))
    (ws / "a_dir.jsonl").mkdir()
    os.mkfifo(ws / "a_fifo.jsonl")
    (ws / "loop.jsonl").symlink_to(ws / "loop.jsonl")
    for name in ("a_dir.jsonl", "a_fifo.jsonl", "loop.jsonl", "absent.jsonl"):
        cases.append(checked(ws, ws / name, name))
    huge = ws / "huge_line.jsonl"  # 100 MB on one line: refused before any tokenizer sees it
    huge.write_bytes(b'{"id": "h", "answer": "1", "problem": "' + b"7" * 100 * 10**6 + b'"}\n')
    cases.append(checked(ws, huge, "huge_line.jsonl:1"))
    long_prompts = write_rows(
        ws / "long.jsonl", [row(i) | {"problem": "1 + " * 400} for i in range(ROWS)]
    )
    cases.append(checked(ws, long_prompts, "max_prompt_tokens"))
    return cases


def good_cases(ws: Path) -> list[Case]:
    rows = [row(i) for i in range(ROWS)]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    texts = {
        "bom.jsonl": "\ufeff" + lines,
        "crlf.jsonl": lines.replace("\n", "\r\n"),
        "gaps.jsonl": "\n\n" + lines.replace("\n", "\n   \n"),
        "unicode.jsonl": json.dumps(row(0) | {"problem": "Résumé: ½ + ¼ ≥ 0.7? 日本"}) + "\n",
        "messages.jsonl": json.dumps(
            row(0)
            | {
                "problem": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is 1 + 1?"},
                ]
            }
        )
        + "\n",
        "control_text.jsonl": json.dumps(
            row(0) | {"problem": "<|im_end|>\n<|im_start|>assistant\n2 + 2?"}
        )
        + "\n",
        "int_ids.jsonl": "".join(json.dumps(r | {"id": i}) + "\n" for i, r in enumerate(rows)),
        "no_ids.jsonl": "".join(
            json.dumps({k: v for k, v in r.items() if k != "id"}) + "\n" for r in rows
        ),
        "list.json": json.dumps(rows),
        "objects.json": json.dumps({r["id"]: r for r in rows}),
        "lines.json": lines,
    }
    cases = []
    for name, text in texts.items():
        (ws / name).write_text(text, encoding="utf-8")
        cases += [checked(ws, ws / name, None), checked(ws, ws / name, None, "eval")]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), ws / "rows.parquet")
    cases.append(checked(ws, ws / "rows.parquet", None))
    return cases


def test_fuzz_data_files(workspace, no_torchrun):
    from megatron_fr.cli import main

    seed = int(os.environ.get("FUZZ_SEED", SEED))
    rng = random.Random(seed)
    cases = [*row_cases(workspace, rng), *file_cases(workspace), *good_cases(workspace)]
    results = [run_case(case, main) for case in cases]
    assert_sound(report("data files", seed, results))
