"""Prompt files (envs/datasets.py): field mapping for verl / slime layouts in JSONL, JSON and
Parquet, errors that name the file, row and field, prompt-length filtering against
transformers' own chat template, and the loader on a real public data set shipped on PyPI
(champ-dataset: the CHAMP competition-math problems)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_fr.demo.chat_tokenizer import build_chat_tokenizer
from megatron_fr.envs.datasets import (
    DatasetConfig,
    load_dataset,
    load_samples,
    write_jsonl,
)
from megatron_fr.envs.math_env import MathEnvConfig, MathEnvironment
from megatron_fr.envs.python_tool import PythonToolConfig, PythonToolEnvironment
from megatron_fr.rollout.chat import chat_format, filter_by_prompt_length

VERL_ROWS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "Find $1+1$.\n\nAnswer: $Answer"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "2", "style": "rule"},
        "extra_info": {"index": "a-1", "split": "train"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [
            {"role": "system", "content": "Think."},
            {"role": "user", "content": "Find $2^3$."},
        ],
        "ability": "MATH",
        "reward_model": {"ground_truth": "8", "style": "rule"},
        "extra_info": {"index": "a-2", "split": "train"},
    },
]
VERL = dict(prompt_key="prompt", label_key="reward_model.ground_truth", id_key="extra_info.index")


def write(path: Path, rows: list) -> Path:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_verl_rows_map_onto_the_fields_the_environments_read(tmp_path, suffix):
    path = write(tmp_path / f"dapo{suffix}", VERL_ROWS)
    samples = load_dataset(DatasetConfig(path=str(path), **VERL))
    assert [s["id"] for s in samples] == ["a-1", "a-2"]
    assert [s["answer"] for s in samples] == ["2", "8"]
    assert samples[0]["problem"] == "Find $1+1$.\n\nAnswer: $Answer"
    assert samples[1]["messages"] == VERL_ROWS[1]["prompt"]
    assert samples[1]["problem"] == "Find $2^3$."  # the last user message
    assert samples[0]["data_source"] == "math_dapo"  # the row's own fields stay
    assert MathEnvironment().start(samples[1]).messages[-1]["content"].startswith("Find $2^3$.")


def test_plain_rows_metadata_limit_and_numbered_ids(tmp_path):
    rows = [{"question": "1+1?", "label": 2, "meta": {"game": "g1"}}] * 3
    path = write(tmp_path / "plain.jsonl", rows)
    config = DatasetConfig(
        path=str(path),
        prompt_key="question",
        label_key="label",
        metadata_keys={"game_file": "meta.game"},
    )
    samples = load_dataset(config)
    assert [s["id"] for s in samples] == ["plain-0", "plain-1", "plain-2"]
    assert samples[0]["problem"] == "1+1?" and samples[0]["game_file"] == "g1"
    assert samples[0]["answer"] == 2  # a number stays one (the environments str() it)
    assert len(load_dataset(config.model_copy(update={"limit": 2}))) == 2
    games = load_samples(path)  # rows as they are (game specs carry no prompt)
    assert games[0] == {"id": "plain-0", **rows[0]}


def test_json_documents_with_records_under_a_key(tmp_path):
    document = {"problems": {"P1": {"identifier": "P1", "text": "x?", "ans": "1"}}, "other": {}}
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(document))
    config = DatasetConfig(
        path=str(path),
        records_key="problems",
        id_key="identifier",
        prompt_key="text",
        label_key="ans",
    )
    assert load_dataset(config)[0]["id"] == "P1"
    with pytest.raises(ValueError, match=r"doc\.json: no records under 'nope'"):
        load_dataset(config.model_copy(update={"records_key": "nope"}))
    lines = write(tmp_path / "lines.json", [])  # JSON lines under a .json name load too
    lines.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": "2"}\n')
    assert [s["id"] for s in load_dataset(DatasetConfig(path=str(lines)))] == ["lines-0", "lines-1"]


@pytest.mark.parametrize(
    ("rows", "config", "message"),
    [
        ([], {}, r"empty\.jsonl: no rows"),
        ([{"problem": "a"}], {}, r"bad\.jsonl: line 1: no field 'answer' \(label_key\)"),
        (
            [{"problem": "a", "answer": "1"}, {"answer": "2"}],
            {},
            r"bad\.jsonl: line 2: no field 'problem' \(prompt_key\)",
        ),
        ([{"problem": "a", "answer": ["1"]}], {}, r"line 1: field 'answer' .* got list"),
        ([{"problem": "a", "answer": True}], {}, r"line 1: field 'answer' .* got bool"),
        ([{"problem": "", "answer": "1"}], {}, r"line 1: the prompt must be"),
        ([{"problem": [{"role": "bot", "content": "x"}], "answer": "1"}], {}, "the prompt must"),
        ([{"id": 1.5, "problem": "a", "answer": "1"}], {}, r"field 'id' \(id\) must be"),
        (
            [{"id": "x", "problem": "a", "answer": "1"}] * 2,
            {},
            r"bad\.jsonl: line 2: duplicate id 'x' \(first at line 1\)",
        ),
        (
            [{"id": 1, "problem": "a", "answer": "1"}, {"id": "1", "problem": "b", "answer": "2"}],
            {},
            r"bad\.jsonl: line 2: duplicate id '1' \(first at line 1 as 1\)",
        ),
        ([{"problem": "\ud800", "answer": "1"}], {}, r"line 1: holds a lone surrogate"),
        (
            [{"id": 1, "problem": "a", "answer": "1"}, {"id": 2, "problem": "b", "answer": "2"}],
            {},
            None,
        ),
        ([{"problem": "a", "answer": "1"}], {"metadata_keys": {"g": "m.g"}}, r"'m\.g'"),
        ([[1, 2]], {}, r"line 1 is not an object"),
    ],
)
def test_bad_rows_are_refused_naming_file_row_and_field(tmp_path, rows, config, message):
    path = write(tmp_path / ("empty.jsonl" if not rows else "bad.jsonl"), rows)
    if message is None:  # a control: the same kind of row, well-formed
        assert load_dataset(DatasetConfig(path=str(path), **config))
        return
    with pytest.raises(ValueError, match=message):
        load_dataset(DatasetConfig(path=str(path), **config))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000 + b"\n", r"deep\.jsonl:1: nested deeper than JSON"),
        (b'{"problem": "\xe9", "answer": "1"}\n', r"deep\.jsonl: not UTF-8 text \(byte 13"),
    ],
)
def test_deep_nesting_and_other_encodings_are_refused_naming_the_file(tmp_path, data, message):
    path = tmp_path / "deep.jsonl"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        load_dataset(DatasetConfig(path=str(path)))


def test_a_byte_order_mark_is_not_content(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"id": "a", "problem": "p", "answer": "1"}\n')
    assert [s["id"] for s in load_dataset(DatasetConfig(path=str(path)))] == ["a"]


def test_missing_files_and_unknown_formats_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.jsonl"):
        load_dataset(DatasetConfig(path=str(tmp_path / "nowhere.jsonl")))
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"p\.csv: expected a \.jsonl or \.parquet"):
        load_dataset(DatasetConfig(path=str(tmp_path / "p.csv")))
    with pytest.raises(ValueError, match="prompt_kee"):
        DatasetConfig(path="x.jsonl", prompt_kee="prompt")


def test_write_jsonl_is_whole_or_nothing(tmp_path):
    target = tmp_path / "rows.jsonl"
    with pytest.raises(TypeError):
        write_jsonl(target, [{"id": "a"}, {"id": "b", "bad": object()}])
    assert list(tmp_path.iterdir()) == []
    write_jsonl(target, [{"id": "a", "problem": "é", "answer": "1"}])
    assert load_samples(target) == [{"id": "a", "problem": "é", "answer": "1"}]


def test_prompt_length_filter_counts_what_the_agent_loop_would_send(tmp_path):
    """Lengths checked against transformers' apply_chat_template on each environment's own
    opening messages (the python tool's prompt carries the tool schema)."""
    rows = [{"id": str(n), "problem": "What is 2 + 2? " * n, "answer": "4"} for n in range(1, 30)]
    tokenizer = build_chat_tokenizer([[{"role": "user", "content": rows[0]["problem"]}]], 300)
    chat = chat_format(tokenizer)
    for env in (MathEnvironment(MathEnvConfig()), PythonToolEnvironment(PythonToolConfig())):
        lengths = {}
        for row in rows:
            episode = env.start(row)
            lengths[row["id"]] = len(
                tokenizer.apply_chat_template(
                    episode.messages, tools=episode.tools, add_generation_prompt=True
                )["input_ids"]
            )
        limit = sorted(lengths.values())[10]
        kept, dropped = filter_by_prompt_length(rows, env, chat, limit)
        assert [s["id"] for s in kept] == [i for i, n in lengths.items() if n <= limit]
        assert dropped == len(rows) - len(kept) > 0
        env.close()
    assert filter_by_prompt_length(rows, MathEnvironment(), chat, 10**6) == (rows, 0)


def champ_file() -> Path:
    spec = importlib.util.find_spec("champ_dataset")
    if spec is None:
        pytest.skip("champ-dataset (CHAMP competition math, MIT, on PyPI) is not installed")
    return Path(spec.submodule_search_locations[0]) / "dataset_files" / "v0.json"


def test_a_public_math_dataset_from_pypi_loads_and_grades():
    """CHAMP's 270 problems, as the package ships them (one JSON document, rows keyed by id)."""
    from megatron_fr.envs.math_grader import MathGrader

    config = DatasetConfig(
        path=str(champ_file()),
        records_key="problems",
        id_key="identifier",
        prompt_key="_text",
        label_key="_answer",
    )
    samples = load_dataset(config)
    assert len(samples) == 270 and len({s["id"] for s in samples}) == 270
    first = next(s for s in samples if s["id"] == "P_Combinatorics_1")
    assert first["problem"].startswith("Let a string consist of digit 1, 2, 3.")
    assert first["answer"] == "239"
    episode = MathEnvironment().start(first)
    assert episode.messages[-1]["content"].startswith(first["problem"])
    with MathGrader() as grader:
        assert grader.grade("The count is \\boxed{239}.", first["answer"]).correct
        assert not grader.grade("\\boxed{238}", first["answer"]).correct
