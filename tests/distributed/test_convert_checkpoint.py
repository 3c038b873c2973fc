"""The conversion tools on tiny transformers models: HF -> megatron torch_dist -> HF is bitwise,
the dist checkpoint loads in every layout and computes transformers' logits, and bad input
is refused with the tensor or setting named and no output left behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_qwen import tiny_checkpoint

from megatron_fr.config import ParallelConfig
from megatron_fr.convert.cli import main as convert_main
from megatron_fr.parallel.spawn import run_on_ranks

REPO = Path(__file__).resolve().parents[2]


def convert_cli(*args: str) -> subprocess.CompletedProcess:
    """The real command line, in its own process (as a user runs it)."""
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    )


def assert_same_hf_checkpoint(converted: Path, original: Path) -> None:
    """Same tensor names, every tensor bitwise equal, and an index that lists real shards."""
    from tiny_qwen import saved_tensors

    expected, actual = saved_tensors(original), saved_tensors(converted)
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), f"{name} changed in the round trip"
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == expected.keys()
    for name, file in index["weight_map"].items():
        assert name in load_file(converted / file), f"{name} is not in {file}"
    total = sum(t.numel() * t.element_size() for t in expected.values())
    assert index["metadata"]["total_size"] == total
    assert json.loads((converted / "config.json").read_text()) == json.loads(
        (original / "config.json").read_text()
    )


def no_output_left(out: Path) -> bool:
    return not out.exists() and not any(
        p.name.startswith(f".{out.name}.") for p in out.parent.iterdir()
    )


@pytest.mark.distributed
def test_cli_round_trip_is_bitwise_and_verify_reports_logit_error(tmp_path):
    """qwen3_moe through the command line: a sharded HF checkpoint in, the same bytes out;
    verify at PP2 prints max |dlogit| <= 1e-4 and exits 1 when asked for a tolerance below it."""
    hf, megatron, back = tmp_path / "hf", tmp_path / "megatron", tmp_path / "back"
    tiny_checkpoint("qwen3_moe", hf, max_shard_size="150KB")
    assert len(list(hf.glob("*.safetensors"))) >= 2, "the source should be sharded"

    result = convert_cli("hf-to-megatron", "--hf-dir", hf, "--out", megatron)
    assert result.returncode == 0, result.stderr
    assert (megatron / "metadata.json").exists() and (megatron / "hf_config.json").exists()

    result = convert_cli(
        "megatron-to-hf",
        "--megatron-dir",
        megatron,
        "--out",
        back,
        "--hf-config-dir",
        hf,
        "--max-shard-size",
        "100KB",
    )
    assert result.returncode == 0, result.stderr
    assert len(list(back.glob("model-*-of-*.safetensors"))) >= 3
    assert (back / "generation_config.json").exists()
    assert_same_hf_checkpoint(back, hf)

    result = convert_cli(
        "verify", "--hf-dir", hf, "--megatron-dir", megatron, "--pp", "2", "--tolerance", "1e-12"
    )
    match = re.search(r"max \|dlogit\| = (\S+) at tp1 ep1 etp1 pp2", result.stdout)
    assert match, result.stdout + result.stderr
    assert 0 < float(match.group(1)) <= 1e-4
    assert result.returncode == 1 and "FAIL" in result.stdout


def convert_on_one_rank(rank: int, world_size: int, root: str) -> dict:
    """The library API for qwen3 and qwen2 (tied, QKV bias) and every bad-input case, in one
    process (one megatron import). Returns each error message by case."""
    from unittest import mock

    from megatron_fr.convert import checkpoint

    root_path, errors = Path(root), {}
    for family in ("qwen3", "qwen2"):
        checkpoint.hf_to_megatron_checkpoint(root_path / family, root_path / f"{family}.megatron")
        checkpoint.megatron_to_hf_checkpoint(
            root_path / f"{family}.megatron", root_path / f"{family}.back", max_shard_bytes=60_000
        )
    cases = {
        "missing": ("hf-missing", "hf_to_megatron"),
        "extra": ("hf-extra", "hf_to_megatron"),
        "shape": ("hf-shape", "hf_to_megatron"),
        "model_type": ("hf-llama", "hf_to_megatron"),
        "truncated": ("hf-truncated", "hf_to_megatron"),
        "exists": ("qwen3", "hf_to_megatron"),
        "config_mismatch": ("qwen2.megatron", "megatron_to_hf"),
    }
    for case, (source, direction) in cases.items():
        out = root_path / ("qwen3.megatron" if case == "exists" else f"out-{case}")
        try:
            if direction == "hf_to_megatron":
                checkpoint.hf_to_megatron_checkpoint(root_path / source, out)
            else:
                checkpoint.megatron_to_hf_checkpoint(
                    root_path / source, out, hf_config_dir=root_path / "qwen3"
                )
        except (ValueError, FileExistsError) as error:
            errors[case] = str(error)
    with mock.patch.object(
        checkpoint, "load_hf_into_model", side_effect=RuntimeError("interrupted")
    ):
        try:
            checkpoint.hf_to_megatron_checkpoint(root_path / "qwen3", root_path / "out-crash")
        except RuntimeError as error:
            errors["crash"] = str(error)
    return errors


def rewrite_shard(directory: Path, edit) -> None:
    """Apply edit(tensors) to the (single) safetensors file of a copied checkpoint."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def copy_checkpoint(source: Path, target: Path) -> Path:
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


@pytest.mark.distributed
def test_dense_round_trips_and_bad_input_is_refused_with_nothing_left(tmp_path):
    for family in ("qwen3", "qwen2"):
        tiny_checkpoint(family, tmp_path / family)
    rewrite_shard(
        copy_checkpoint(tmp_path / "qwen3", tmp_path / "hf-missing"),
        lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
    )
    rewrite_shard(
        copy_checkpoint(tmp_path / "qwen3", tmp_path / "hf-extra"),
        lambda t: t.update({"model.layers.1.mlp.extra.weight": torch.zeros(3)}),
    )
    rewrite_shard(
        copy_checkpoint(tmp_path / "qwen3", tmp_path / "hf-shape"),
        lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 95)}),
    )
    truncated = copy_checkpoint(tmp_path / "qwen3", tmp_path / "hf-truncated")
    with open(truncated / "model.safetensors", "r+b") as handle:
        handle.truncate(handle.seek(0, 2) - 4096)  # a copy cut short
    llama = copy_checkpoint(tmp_path / "qwen3", tmp_path / "hf-llama")
    config = json.loads((llama / "config.json").read_text()) | {"model_type": "llama"}
    (llama / "config.json").write_text(json.dumps(config))

    (errors,) = run_on_ranks(convert_on_one_rank, 1, str(tmp_path), timeout_s=600)

    for family in ("qwen3", "qwen2"):
        assert_same_hf_checkpoint(tmp_path / f"{family}.back", tmp_path / family)
    assert "missing tensors ['model.layers.1.self_attn.k_proj.weight']" in errors["missing"]
    assert "unexpected tensors ['model.layers.1.mlp.extra.weight']" in errors["extra"]
    assert (
        "model.layers.0.mlp.down_proj.weight: shape [64, 95] in the checkpoint, [64, 96]"
        in (errors["shape"])
    )
    assert "llama" in errors["model_type"]
    assert f"{truncated / 'model.safetensors'}: the header declares" in errors["truncated"]
    assert "already exists" in errors["exists"]
    assert "q_layernorm" in errors["config_mismatch"]
    assert errors["crash"] == "interrupted"
    for case in (
        "missing",
        "extra",
        "shape",
        "model_type",
        "truncated",
        "config_mismatch",
        "crash",
    ):
        assert no_output_left(tmp_path / f"out-{case}"), case


LAYOUTS = {  # family -> layouts the dist checkpoint is loaded in (DP fills the 4 ranks)
    "qwen3_moe": [
        dict(),
        dict(tensor=2, sequence_parallel=True),
        dict(expert=2),
        dict(tensor=2, expert=2, sequence_parallel=True),
        dict(pipeline=2),
        dict(pipeline=2, expert=2),
    ],
    "qwen3": [dict(tensor=2), dict(pipeline=2)],
    "qwen2": [dict(pipeline=2), dict(tensor=2, pipeline=2)],  # tied embeddings across stages
}


@pytest.mark.distributed
def test_dist_checkpoint_loads_in_every_layout_with_transformers_logits(tmp_path):
    from megatron_fr.convert.verify import (
        VerifyJob,
        collect_logits,
        hf_logits,
        megatron_logits_on_rank,
        random_tokens,
    )

    jobs, expected = [], []
    for family, layouts in LAYOUTS.items():
        config, _, _, _ = tiny_checkpoint(family, tmp_path / family)
        result = convert_cli(
            "hf-to-megatron", "--hf-dir", tmp_path / family, "--out", tmp_path / f"{family}.m"
        )
        assert result.returncode == 0, result.stderr
        tokens = random_tokens(config["vocab_size"], seq=16)
        logits = hf_logits(tmp_path / family, tokens)
        for kwargs in layouts:
            jobs.append(
                VerifyJob(str(tmp_path / f"{family}.m"), config, ParallelConfig(**kwargs), tokens)
            )
            expected.append((family, kwargs, logits))
    per_rank = run_on_ranks(megatron_logits_on_rank, 4, jobs, timeout_s=900)
    for logits, (family, layout, reference) in zip(collect_logits(per_rank), expected, strict=True):
        error = (logits - reference).abs().max().item()
        assert error <= 1e-4, f"{family} at {layout}: max |dlogit| {error}"


def test_layouts_that_cannot_fit_are_refused_by_name(tmp_path, capsys):
    tiny_checkpoint("qwen3_moe", tmp_path)  # 2 query groups, 4 experts
    for flags, message in (
        (["--tp", "4"], "TP 4 does not divide the 2 query groups"),
        (["--ep", "3"], "EP 3 does not divide the 4 experts"),
    ):
        code = convert_main(["verify", "--hf-dir", str(tmp_path), "--megatron-dir", "x", *flags])
        assert code == 2
        assert message in capsys.readouterr().err
