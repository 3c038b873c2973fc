"""Loading HF files straight into a parallel model, and exporting one back, on real megatron
ranks: every rank reads only its slices, and the result is transformers' model (logits), the
same parameters bit for bit as loading the converted dist checkpoint (megatron's own
resharding), and an export identical to the source checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_convert_checkpoint import assert_same_hf_checkpoint, copy_checkpoint
from tiny_qwen import tiny_checkpoint, to_megatron_on_rank

from megatron_fr.config import ParallelConfig
from megatron_fr.parallel.spawn import run_on_ranks

LAYOUTS = {  # family -> layouts (DP fills the 4 ranks)
    "qwen3_moe": [
        dict(tensor=2, sequence_parallel=True),
        dict(expert=2),
        dict(pipeline=2),
        dict(tensor=2, expert=2, sequence_parallel=True),
    ],
    "qwen3": [dict(tensor=2), dict(pipeline=2)],
    "qwen2": [dict(tensor=2, pipeline=2)],  # QKV bias; tied embeddings across stages
}


def fc1_layout_disagreements(model) -> list[str]:
    """Split fc1 parameters whose shard rows (shard.partition_stride, with the stride-1 mark
    transformer-engine's grouped experts carry) differ from where megatron's own checkpoint
    factory (apply_swiglu_sharded_factory) puts them in the full tensor."""
    from types import SimpleNamespace

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    from megatron_fr.convert.shard import partition_stride, shard_group, shard_ranges

    params, wrong = dict(model.named_parameters()), []
    for name, entry in model.sharded_state_dict().items():
        group = shard_group(name, params.get(name))
        if not isinstance(entry, ShardedTensorFactory) or group is None:
            continue
        rank, size = group
        megatron = [
            (
                part.global_offset[part.prepend_axis_num],
                part.global_offset[part.prepend_axis_num] + part.local_shape[0],
            )
            for part in entry.build()
        ]
        full_rows = params[name].shape[0] * size
        te_grouped = SimpleNamespace(partition_stride=1)  # what TE's grouped experts report
        for variant in (
            name,
            name.replace(".local_experts.0.linear_fc1.weight", ".linear_fc1.weight0"),
        ):
            if (
                shard_ranges(full_rows, size, partition_stride(variant, te_grouped), rank)
                != megatron
            ):
                wrong.append(variant)
    return wrong


def load_both_ways_and_export(rank: int, world_size: int, jobs: list[dict]) -> list[dict]:
    """Per job: parameters that differ between the direct load and the converted checkpoint,
    the logits (last stage, TP/DP rank 0), and the export written from the direct load."""
    from megatron.core import parallel_state as ps

    from megatron_fr.convert.checkpoint import load_megatron_checkpoint
    from megatron_fr.convert.parallel_export import export_hf_from_model
    from megatron_fr.convert.parallel_load import load_hf_into_model
    from megatron_fr.convert.verify import pipeline_logits
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    results = []
    for job in jobs:
        parallel = ParallelConfig(**job["layout"])
        state.initialize(parallel, seed=0)
        spec = load_hf_config(job["config"])
        direct, converted = (
            build_gpt_model(spec, parallel, params_dtype=torch.float32) for _ in range(2)
        )
        report = load_hf_into_model(direct, job["hf_dir"], spec, progress=False)
        load_megatron_checkpoint(converted, job["megatron_dir"])
        pairs = zip(direct.named_parameters(), converted.parameters(), strict=True)
        differ = [name for (name, a), b in pairs if not torch.equal(a, b)]
        logits = pipeline_logits(direct.eval(), job["tokens"], parallel)
        if ps.get_tensor_model_parallel_rank() or ps.get_data_parallel_rank():
            logits = None
        config_text = (Path(job["hf_dir"]) / "config.json").read_text()
        export_hf_from_model(
            direct,
            spec,
            job["export"],
            config_text=config_text,
            files_from=job["hf_dir"],
            max_shard_bytes=40_000,
            progress=False,
        )
        results.append(
            {
                "differ": differ,
                "logits": logits,
                "bytes_read": report.bytes_read,
                "fc1_layout": fc1_layout_disagreements(direct),
            }
        )
    return results


def refused_on_every_rank(rank: int, world_size: int, cases: dict) -> dict:
    """Bad input (a shape that does not match, an export target that exists) is refused on
    every rank with the same message, nobody left waiting in a collective."""
    from megatron_fr.convert.parallel_export import export_hf_from_model
    from megatron_fr.convert.parallel_load import load_hf_into_model
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    parallel = ParallelConfig(tensor=2)
    state.initialize(parallel, seed=0)
    spec = load_hf_config(cases["config"])
    model = build_gpt_model(spec, parallel, params_dtype=torch.float32)
    errors = {}
    try:
        load_hf_into_model(model, cases["bad_shape"], spec, progress=False)
    except ValueError as error:
        errors["shape"] = str(error)
    try:
        export_hf_from_model(model, spec, cases["exists"], config_text="{}", progress=False)
    except ValueError as error:
        errors["exists"] = str(error)
    return errors


@pytest.mark.distributed
def test_direct_load_matches_transformers_and_conversion_and_exports_bitwise(tmp_path):
    jobs, expected = [], []
    for family, layouts in LAYOUTS.items():
        hf = tmp_path / family
        config, _, tokens, logits = tiny_checkpoint(family, hf, max_shard_size="60KB")
        run_on_ranks(to_megatron_on_rank, 1, str(hf), str(tmp_path / f"{family}.m"), timeout_s=300)
        for index, layout in enumerate(layouts):
            export = tmp_path / f"{family}.export{index}"
            jobs.append(
                dict(
                    family=family,
                    layout=layout,
                    config=config,
                    tokens=tokens,
                    hf_dir=str(hf),
                    megatron_dir=str(tmp_path / f"{family}.m"),
                    export=str(export),
                )
            )
            expected.append(logits)

    per_rank = run_on_ranks(load_both_ways_and_export, 4, jobs, timeout_s=1200)

    for index, (job, reference) in enumerate(zip(jobs, expected, strict=True)):
        where = f"{job['family']} at {job['layout']}"
        for rank_results in per_rank:
            assert rank_results[index]["differ"] == [], f"{where}: direct load differs"
            assert rank_results[index]["fc1_layout"] == [], f"{where}: fc1 shard layout"
        (logits,) = [r[index]["logits"] for r in per_rank if r[index]["logits"] is not None]
        error = (logits - reference).abs().max().item()
        assert error <= 1e-4, f"{where}: max |dlogit| {error}"
        export = Path(job["export"])
        assert_same_hf_checkpoint(export, Path(job["hf_dir"]))
        assert (export / "generation_config.json").exists()
        assert len(list(export.glob("model-*-of-*.safetensors"))) >= 2
        # Each rank reads only its slices: less than the checkpoint in every split layout.
        total = sum(f.stat().st_size for f in Path(job["hf_dir"]).glob("*.safetensors"))
        assert max(r[index]["bytes_read"] for r in per_rank) < total, where
    assert not list(tmp_path.glob(".*")), "a partial directory or owner record was left"


@pytest.mark.distributed
def test_bad_input_is_refused_on_every_rank(tmp_path):
    config, _, _, _ = tiny_checkpoint("qwen3", tmp_path / "qwen3")
    bad = copy_checkpoint(tmp_path / "qwen3", tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 60)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "exists").mkdir()
    cases = dict(config=config, bad_shape=str(bad), exists=str(tmp_path / "exists"))

    per_rank = run_on_ranks(refused_on_every_rank, 2, cases, timeout_s=600)

    for errors in per_rank:
        assert (
            "model.layers.1.self_attn.o_proj.weight: shape [64, 60] in the checkpoint, [64, 64]"
            in errors["shape"]
        )
        assert "already exists" in errors["exists"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "exists", "qwen3"]


@pytest.mark.distributed
def test_verify_command_checks_the_direct_load(tmp_path):
    """`convert verify` without --megatron-dir: the ranks load the HF files directly."""
    from test_convert_checkpoint import convert_cli

    tiny_checkpoint("qwen3_moe", tmp_path, max_shard_size="60KB")
    result = convert_cli("verify", "--hf-dir", tmp_path, "--ep", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "at tp1 ep2 etp1 pp1 (tolerance 0.0001): OK" in result.stdout
