"""Fuzz of `megatron-fr convert`: HF directories with a broken config.json, safetensors files
with malformed headers and data, broken index maps and tensors that do not match the config;
megatron checkpoints cut short or zero-filled; configs that do not match; out-of-range verify
arguments; and the conversions done right. Every bad input must be refused in one line naming
the file, tensor or argument, never a traceback, a hang, or an answer (tests/fuzz/
fuzz_harness.py). The conversions run in this process; verify spawns its ranks."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path

from fuzz_harness import Case, assert_sound, report, run_case

SEED = 32


def safetensors(path: Path, header: object, data: bytes = b"", length: int | None = None) -> None:
    """A file laid out as safetensors: 8-byte header length, the header, the data."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def copy_model(ws: Path, name: str) -> Path:
    directory = ws / "hf" / name
    shutil.copytree(ws / "model", directory)
    return directory


def convert(*argv: str, names: str | None) -> Case:
    return Case(" ".join(argv)[:120], ["convert", *argv], names)


def to_megatron(ws: Path, hf: Path, names: str | None, out: str | None = None) -> Case:
    out = out or str(ws / "out" / hf.name)
    return convert("hf-to-megatron", "--hf-dir", str(hf), "--out", out, names=names)


def config_cases(ws: Path) -> list[Case]:
    config = json.loads((ws / "model" / "config.json").read_text())
    edits = {
        "config_list": [config],
        "no_vocab": {k: v for k, v in config.items() if k != "vocab_size"},
        "zero_heads": config | {"num_attention_heads": 0},
        "llama": config | {"model_type": "llama"},
        "text_size": config | {"hidden_size": "64"},
        "wide": config | {"hidden_size": 128},
        "more_layers": config | {"num_hidden_layers": 3},
        "fewer_experts": config | {"num_experts": 2},
    }
    names = {
        "config_list": "config.json",
        "no_vocab": "vocab_size",
        "zero_heads": "num_attention_heads",
        "llama": "model_type",
        "text_size": "hidden_size",
        "wide": "shape",
        "more_layers": "layers.2",
        "fewer_experts": "experts",
    }
    cases = []
    for name, value in edits.items():
        hf = copy_model(ws, name)
        (hf / "config.json").write_text(json.dumps(value))
        cases.append(to_megatron(ws, hf, names[name]))
    twice = json.dumps(config)[:-1] + ', "num_hidden_layers": 7}'
    deep = json.dumps(config)[:-1] + ', "x": ' + "[" * 50_000 + "]" * 50_000 + "}"
    texts = [("config_not_json", "{"), ("config_empty", ""), ("config_key_twice", twice)]
    for name, text in [*texts, ("config_deep", deep)]:
        hf = copy_model(ws, name)
        (hf / "config.json").write_text(text)
        cases.append(to_megatron(ws, hf, "config.json"))
    hf = copy_model(ws, "no_config")
    (hf / "config.json").unlink()
    cases.append(to_megatron(ws, hf, "config.json"))
    return cases


def safetensors_cases(ws: Path, rng: random.Random) -> list[Case]:
    original = (ws / "model" / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", original[:8])
    header = json.loads(original[8 : 8 + length])
    data = original[8 + length :]
    name = next(k for k in header if k != "__metadata__")
    entry = header[name]

    def with_entry(**change) -> dict:
        return header | {name: entry | change}

    files = {
        "huge_length": lambda p: safetensors(p, header, data, length=2**62),
        "length_past_end": lambda p: safetensors(p, header, data, length=len(data) + 10**6),
        "not_json": lambda p: safetensors(p, b"{not json" + b" " * 20, data),
        "a_list": lambda p: safetensors(p, [1, 2], data),
        "no_dtype": lambda p: safetensors(
            p,
            with_entry(dtype=None) | {name: {k: v for k, v in entry.items() if k != "dtype"}},
            data,
        ),
        "fp8": lambda p: safetensors(p, with_entry(dtype="F8_E4M3"), data),
        "bad_shape": lambda p: safetensors(p, with_entry(shape=["a", 2]), data),
        "negative_offsets": lambda p: safetensors(p, with_entry(data_offsets=[-8, 0]), data),
        "offsets_as_text": lambda p: safetensors(p, with_entry(data_offsets="0-8"), data),
        "offsets_as_strings": lambda p: safetensors(
            p, with_entry(data_offsets=[str(o) for o in entry["data_offsets"]]), data
        ),
        "offsets_as_floats": lambda p: safetensors(
            p, with_entry(data_offsets=[float(o) for o in entry["data_offsets"]]), data
        ),
        "dtype_a_list": lambda p: safetensors(p, with_entry(dtype=["F32"]), data),
        "dtype_an_object": lambda p: safetensors(p, with_entry(dtype={"F32": 1}), data),
        "shape_of_bools": lambda p: safetensors(p, with_entry(shape=[True] * 2), data),
        "shape_a_number": lambda p: safetensors(p, with_entry(shape=64), data),
        "deep_nesting": lambda p: safetensors(
            p,
            json.dumps(header)[:-1].encode() + b', "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
            data,
        ),
        "short_data": lambda p: safetensors(p, header, data[: len(data) // 2]),
        "long_data": lambda p: safetensors(p, header, data + b"\0" * 64),
        "truncated": lambda p: p.write_bytes(original[: rng.randrange(9, len(original) // 2)]),
        "three_bytes": lambda p: p.write_bytes(original[:3]),
        "empty": lambda p: p.write_bytes(b""),
        "zeros": lambda p: p.write_bytes(bytes(len(original))),
        "random_bytes": lambda p: p.write_bytes(rng.randbytes(len(original))),
        "duplicate_names": lambda p: safetensors(
            p,
            json.dumps(header)[:-1].encode() + b", " + json.dumps({name: entry})[1:].encode(),
            data,
        ),
    }
    cases = []
    for kind, write in files.items():
        hf = copy_model(ws, f"st_{kind}")
        write(hf / "model.safetensors")
        cases.append(to_megatron(ws, hf, "model.safetensors"))
    hf = copy_model(ws, "st_missing_tensor")
    safetensors(
        hf / "model.safetensors",
        {k: v for k, v in header.items() if k != name} | {"__metadata__": {}},
        data[:0],
    )
    cases.append(to_megatron(ws, hf, "model.safetensors"))
    hf = copy_model(ws, "st_none")
    (hf / "model.safetensors").unlink()
    cases.append(to_megatron(ws, hf, "safetensors"))
    return cases


def index_cases(ws: Path) -> list[Case]:
    original = (ws / "model" / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", original[:8])
    names = [k for k in json.loads(original[8 : 8 + length]) if k != "__metadata__"]
    weight_map = dict.fromkeys(names, "model.safetensors")
    maps = {
        "map_a_list": ({"weight_map": list(weight_map)}, "index.json"),
        "no_weight_map": ({"metadata": {}}, "index.json"),
        "map_to_missing_file": (
            {"weight_map": weight_map | {names[0]: "gone.safetensors"}},
            "gone.safetensors",
        ),
        "map_to_wrong_file": (
            {"weight_map": weight_map | {"lm_head.extra": "model.safetensors"}},
            "lm_head.extra",
        ),
        "map_missing_tensor": (
            {"weight_map": {k: v for k, v in weight_map.items() if k != names[1]}},
            names[1],
        ),
        "map_to_a_directory": ({"weight_map": weight_map | {names[0]: "subdir"}}, "subdir"),
        "map_path_traversal": (
            {"weight_map": weight_map | {names[0]: "../../etc/passwd"}},
            "passwd",
        ),
        "map_value_a_number": ({"weight_map": weight_map | {names[0]: 7}}, "index.json"),
    }
    cases = []
    for kind, (index, names_what) in maps.items():
        hf = copy_model(ws, kind)
        (hf / "subdir").mkdir()
        (hf / "model.safetensors.index.json").write_text(json.dumps(index))
        cases.append(to_megatron(ws, hf, names_what))
    mapped = json.dumps({"weight_map": weight_map})
    texts = {
        "index_not_json": "{",
        "index_tensor_twice": mapped[:-2] + f', "{names[0]}": "other.safetensors"}}}}',
        "index_deep": '{"weight_map": {}, "x": ' + "[" * 50_000 + "]" * 50_000 + "}",
    }
    for kind, text in texts.items():
        hf = copy_model(ws, kind)
        (hf / "model.safetensors.index.json").write_text(text)
        cases.append(to_megatron(ws, hf, "index.json"))
    return cases


def output_cases(ws: Path) -> list[Case]:
    (ws / "a_file").write_text("x")
    (ws / "existing").mkdir()
    return [
        to_megatron(ws, ws / "model", "existing", str(ws / "existing")),
        to_megatron(ws, ws / "model", "a_file", str(ws / "a_file" / "out")),
        to_megatron(ws, ws / "model", "/proc", "/proc/megatron-fr-out"),
        to_megatron(ws, ws / "absent", "absent"),
    ]


def megatron_cases(ws: Path, megatron: Path) -> list[Case]:
    def broken(kind: str, change) -> Path:
        directory = ws / "mg" / kind
        shutil.copytree(megatron, directory)
        change(directory)
        return directory

    shard = "__0_0.distcp"
    breaks = {
        "truncated_shard": (
            lambda d: (d / shard).write_bytes((d / shard).read_bytes()[:999]),
            shard,
        ),
        "zeroed_shard": (
            lambda d: (d / shard).write_bytes(bytes((d / shard).stat().st_size)),
            shard,
        ),
        "no_shard": (lambda d: (d / shard).unlink(), shard),
        "truncated_metadata": (lambda d: (d / ".metadata").write_bytes(b"\x80\x04"), ".metadata"),
        "no_metadata": (lambda d: (d / ".metadata").unlink(), ".metadata"),
        "no_hf_config": (lambda d: (d / "hf_config.json").unlink(), "hf_config.json"),
        "bad_hf_config": (lambda d: (d / "hf_config.json").write_text("[]"), "hf_config.json"),
        "wider_hf_config": (
            lambda d: (d / "hf_config.json").write_text(
                json.dumps(json.loads((d / "hf_config.json").read_text()) | {"hidden_size": 128})
            ),
            "shape",
        ),
    }
    cases = []
    for kind, (change, names) in breaks.items():
        directory = broken(kind, change)
        out = str(ws / "back" / kind)
        cases.append(
            convert("megatron-to-hf", "--megatron-dir", str(directory), "--out", out, names=names)
        )
    (ws / "empty_dir").mkdir()
    for directory, names in [(ws / "empty_dir", "empty_dir"), (ws / "nowhere", "nowhere")]:
        cases.append(
            convert(
                "megatron-to-hf",
                "--megatron-dir",
                str(directory),
                "--out",
                str(ws / "back" / directory.name),
                names=names,
            )
        )
    for size in ("0", "abc", "-5GB", "1e999"):
        cases.append(
            convert(
                "megatron-to-hf",
                "--megatron-dir",
                str(megatron),
                "--out",
                str(ws / "back" / f"size{size}"),
                "--max-shard-size",
                size,
                names="max-shard-size",
            )
        )
    return cases


def verify_cases(ws: Path) -> list[Case]:
    hf = str(ws / "model")
    bad = [
        (["--seq", "0"], "--seq"),
        (["--seq", "-3"], "--seq"),
        (["--seq", "x"], "--seq"),
        (["--tolerance", "nan"], "--tolerance"),
        (["--tolerance", "-1"], "--tolerance"),
        (["--tolerance", "inf"], "--tolerance"),
        (["--tp", "0"], "--tp"),
        (["--tp", "-2"], "--tp"),
        (["--tp", "3"], "TP 3"),
        (["--ep", "3"], "EP 3"),
        (["--pp", "5"], "PP 5"),
        (["--etp", "0"], "--etp"),
        (["--ep", "0"], "--ep"),
        (["--megatron-dir", str(ws / "nowhere")], "nowhere"),
        (["--seq", "100000"], "--seq"),
    ]
    cases = [convert("verify", "--hf-dir", hf, *argv, names=names) for argv, names in bad]
    other = copy_model(ws, "verify_other_model")  # the checkpoint is of ws/model
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = config["num_hidden_layers"] + 1
    (other / "config.json").write_text(json.dumps(config))
    megatron = str(ws / "out" / "good")
    cases.append(
        convert(
            "verify", "--hf-dir", str(other), "--megatron-dir", megatron, names="--megatron-dir"
        )
    )
    cases.append(convert("verify", "--hf-dir", hf, "--megatron-dir", hf, names="--megatron-dir"))
    cases.append(convert("verify", "--hf-dir", str(ws / "nowhere"), names="nowhere"))
    cases.append(convert("verify", names="--hf-dir"))
    cases.append(convert("nonsense", names="nonsense"))
    return cases


def test_fuzz_convert_cli(workspace):
    from megatron_fr.cli import main

    seed = int(os.environ.get("FUZZ_SEED", SEED))
    rng = random.Random(seed)
    ws, megatron = workspace, workspace / "out" / "good"
    good = [
        to_megatron(workspace, workspace / "model", None, str(megatron)),
        convert(
            "megatron-to-hf",
            "--megatron-dir",
            str(megatron),
            "--out",
            str(ws / "back" / "good"),
            names=None,
        ),
        convert(
            "verify",
            "--hf-dir",
            str(ws / "model"),
            "--megatron-dir",
            str(megatron),
            "--seq",
            "8",
            names=None,
        ),
    ]
    results = [run_case(case, main) for case in good]  # the megatron checkpoint the rest uses
    cases = [
        *config_cases(ws),
        *safetensors_cases(ws, rng),
        *index_cases(ws),
        *output_cases(ws),
        *megatron_cases(ws, megatron),
        *verify_cases(ws),
    ]
    results += [run_case(case, main) for case in cases]
    assert_sound(report("convert CLI", seed, results))
