"""HF checkpoint directory <-> megatron dist checkpoint (torch_dist), on one CPU process.

The megatron side is the TP1/EP1/PP1 model in host memory: megatron's own ``sharded_state_dict``
describes every tensor by its global shape, so ``dist_checkpointing.load`` reshards the result
into any TP/EP/ETP/PP layout at load time. Both directions use the code a job's ranks use to
load from and export to HF directly (parallel_load, parallel_export), here on one rank:
memory is one copy of the model plus one tensor in flight (HF -> megatron) or one output shard
(megatron -> HF). Names and shapes are checked before the first byte of weights is read, and
the output is written into a temporary directory renamed only when complete.

One key layout serves megatron's local layer spec (CPU, conversion) and its transformer-engine
spec (GPU): see models/gpt.layer_spec and ``load_megatron_checkpoint``.

Besides megatron's files, the megatron directory holds ``hf_config.json`` (the source
config.json, verbatim) so that converting back needs nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.convert.dcp_files import megatron_checkpoint_problem
from megatron_fr.convert.parallel_export import export_hf_from_model
from megatron_fr.convert.parallel_load import load_hf_into_model
from megatron_fr.convert.qwen import megatron_to_hf
from megatron_fr.models.hf_config import HFModelSpec, spec_from_dict
from megatron_fr.utils.atomic_dir import atomic_directory, refuse_existing
from megatron_fr.utils.hf_checkpoint import HFCheckpointReader
from megatron_fr.utils.strict_json import loads_unique

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

HF_CONFIG_NAME = "hf_config.json"


@dataclass(frozen=True)
class ConversionReport:
    tensors: int
    bytes: int
    dtype: torch.dtype


def _tp1_model(spec: HFModelSpec, dtype: torch.dtype, *, meta: bool = False) -> GPTModel:
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.parallel import state

    state.initialize_single_process()
    return build_gpt_model(
        spec, ParallelConfig(), params_dtype=dtype, meta=meta, initialize=False, on_cpu=True
    )


def expected_hf_tensors(spec: HFModelSpec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF name -> meta tensor with the shape the config implies (from the meta megatron model,
    through the same mapping the conversion uses, so the two cannot disagree)."""
    model = _tp1_model(spec, dtype, meta=True)
    return megatron_to_hf(spec, dict(model.named_parameters()))


def hf_dtype(reader: HFCheckpointReader) -> torch.dtype:
    """The one dtype of every tensor (the megatron checkpoint keeps it); ValueError if mixed."""
    dtypes = {entry.dtype for entry in reader.tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"{reader.directory}: mixed tensor dtypes {sorted(map(str, dtypes))}")
    return dtypes.pop()


def read_hf_config(file: Path, text: str | None = None) -> HFModelSpec:
    """The model of an HF config.json (its text, when already read); ValueError naming the
    file and the field for one no model can be built from."""
    try:
        return spec_from_dict(loads_unique(file.read_text() if text is None else text))
    except RecursionError:
        raise ValueError(f"{file}: nested deeper than JSON can be read here") from None
    except ValueError as error:
        raise ValueError(f"{file}: {error}") from None


def hf_to_megatron_checkpoint(
    hf_dir: str | Path, out: str | Path, *, progress: bool = True
) -> ConversionReport:
    """Convert an HF safetensors checkpoint directory into a megatron torch_dist checkpoint."""
    from megatron.core import dist_checkpointing

    hf_dir, out = Path(hf_dir), refuse_existing(out)
    config_text = (hf_dir / "config.json").read_text()
    spec = read_hf_config(hf_dir / "config.json", config_text)
    with HFCheckpointReader(hf_dir) as reader:
        dtype = hf_dtype(reader)
    model = _tp1_model(spec, dtype)
    with atomic_directory(out) as partial:
        report = load_hf_into_model(model, hf_dir, spec, progress=progress)
        dist_checkpointing.save(model.sharded_state_dict(), str(partial))
        (partial / HF_CONFIG_NAME).write_text(config_text)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return ConversionReport(report.tensors, nbytes, dtype)


def megatron_dtype(megatron_dir: Path) -> torch.dtype:
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(str(megatron_dir))
    key = "embedding.word_embeddings.weight"
    if key not in metadata:
        raise ValueError(f"{megatron_dir}: no {key} in the checkpoint (not a GPT model?)")
    return metadata[key].dtype


OPTIONAL_KEY_SUFFIX = "_extra_state"
"""Keys one layer spec has and the other may not: transformer-engine modules (norms included)
carry an ``_extra_state`` (FP8 scaling metadata, empty without FP8) that local modules lack."""
LEGACY_KEYS = {
    "decoder.layers.pre_mlp_layernorm.weight": "decoder.layers.mlp.linear_fc1.layer_norm_weight"
}
"""Key asked for -> the key older local-spec checkpoints of MoE models stored it under."""


def use_legacy_keys(request: dict, megatron_dir: Path) -> None:
    """Point requested keys the checkpoint lacks at their legacy names when it has those.

    `request` is any sharded state dict about to be loaded from `megatron_dir` (a model's, or
    a learner's model + optimizer state), changed in place."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    stored = dist_checkpointing.load_tensors_metadata(str(megatron_dir))
    for entry in nested_values(request):
        if not isinstance(entry, ShardedTensor) or entry.key in stored:
            continue
        if LEGACY_KEYS.get(entry.key) in stored:
            entry.key = LEGACY_KEYS[entry.key]


def _mismatch(kind: str, keys: Iterable[str]) -> str:
    keys = sorted(k for k in keys if not k.endswith(OPTIONAL_KEY_SUFFIX))
    return f"{kind} {keys[:8]}{' ...' if len(keys) > 8 else ''}" if keys else ""


def load_megatron_checkpoint(model: GPTModel, megatron_dir: str | Path) -> None:
    """Load a torch_dist checkpoint into this rank's model (megatron reshards to its layout).

    Every tensor the model asks for must be in the checkpoint and vice versa, except the
    ``_extra_state`` entries only one layer spec has, so a checkpoint written under the local
    spec loads under the TE spec and the reverse. A mismatch with the config becomes a
    ValueError naming the tensors, shapes or keys involved.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    request = model.sharded_state_dict()
    use_legacy_keys(request, Path(megatron_dir))
    try:
        loaded, unrequested, absent = dist_checkpointing.load(
            request, str(megatron_dir), strict=StrictHandling.RETURN_ALL
        )
    except (CheckpointingException, CheckpointException) as error:
        # torch's holds each rank's (error, stack): the first error is the reason
        failures = list(getattr(error, "failures", {}).values())
        reason = failures[0][0] if failures and isinstance(failures[0], tuple) else error
        raise ValueError(f"{megatron_dir} does not match the model config: {reason}") from error
    wrong = [
        _mismatch("the model asks for keys the checkpoint lacks:", absent),
        _mismatch("the checkpoint holds keys the model does not ask for:", unrequested),
    ]
    if any(wrong):
        raise ValueError(
            f"{megatron_dir} does not match the model config: {'; '.join(filter(None, wrong))}"
        )
    result = model.load_state_dict(loaded, strict=False)
    wrong = [
        _mismatch("parameters not loaded:", result.missing_keys),
        _mismatch("unknown entries:", result.unexpected_keys),
    ]
    if any(wrong):
        raise ValueError(f"{megatron_dir}: {'; '.join(filter(None, wrong))}")


def _hf_config(megatron_dir: Path, hf_config_dir: Path | None) -> tuple[str, HFModelSpec]:
    source = hf_config_dir / "config.json" if hf_config_dir else megatron_dir / HF_CONFIG_NAME
    if not source.exists():
        raise FileNotFoundError(
            f"{source} not found: pass --hf-config-dir with the model's config.json"
        )
    text = source.read_text()
    return text, read_hf_config(source, text)


def megatron_to_hf_checkpoint(
    megatron_dir: str | Path,
    out: str | Path,
    *,
    hf_config_dir: str | Path | None = None,
    max_shard_bytes: int = 5 * 10**9,
    progress: bool = True,
) -> ConversionReport:
    """Convert a megatron torch_dist checkpoint (any layout it was saved from) into HF
    sharded safetensors + model.safetensors.index.json + config.json.

    With ``hf_config_dir``, its other non-weight files (tokenizer, generation config) are
    copied too, so the output is a complete HF model directory.
    """
    megatron_dir = Path(megatron_dir)
    out = refuse_existing(out)
    problem = megatron_checkpoint_problem(megatron_dir)
    if problem is not None:
        raise ValueError(problem)
    config_text, spec = _hf_config(megatron_dir, Path(hf_config_dir) if hf_config_dir else None)
    dtype = megatron_dtype(megatron_dir)
    model = _tp1_model(spec, dtype)
    load_megatron_checkpoint(model, megatron_dir)
    report = export_hf_from_model(
        model,
        spec,
        out,
        config_text=config_text,
        files_from=hf_config_dir,
        max_shard_bytes=max_shard_bytes,
        progress=progress,
    )
    return ConversionReport(report.tensors, report.bytes, dtype)
