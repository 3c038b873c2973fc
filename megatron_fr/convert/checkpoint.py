"""HF checkpoint directory <-> megatron dist checkpoint (torch_dist), on one CPU process.

The megatron side is the TP1/EP1/PP1 model in host memory: megatron's own ``sharded_state_dict``
describes every tensor by its global shape, so ``dist_checkpointing.load`` reshards the result
into any TP/EP/ETP/PP layout at load time. Memory: one copy of the model plus one decoder layer
in flight (HF -> megatron) or one output shard (megatron -> HF); HF tensors are read and
written layer by layer, never the whole checkpoint at once. Both directions check names and
shapes before the first byte of weights is read, and write into a temporary directory that is
renamed only when complete.

Besides megatron's files, the megatron directory holds ``hf_config.json`` (the source
config.json, verbatim) so that converting back needs nothing else.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import megatron_fr.parallel  # noqa: F401  (installs the import shim megatron needs on CPU)
from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.convert.hf_files import (
    WEIGHT_SUFFIXES,
    HFCheckpointReader,
    ShardedSafetensorsWriter,
)
from megatron_fr.convert.qwen import (
    hf_layer_names,
    layer_hf_to_megatron,
    layer_megatron_to_hf,
    megatron_to_hf,
    outer_pairs,
)
from megatron_fr.models.hf_config import HFModelSpec, load_hf_config
from megatron_fr.utils.atomic_dir import atomic_directory, refuse_existing

HF_CONFIG_NAME = "hf_config.json"


@dataclass(frozen=True)
class ConversionReport:
    tensors: int
    bytes: int
    dtype: torch.dtype


def _tp1_model(spec: HFModelSpec, dtype: torch.dtype, *, meta: bool = False):
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


def check_hf_tensors(spec: HFModelSpec, reader: HFCheckpointReader) -> torch.dtype:
    """Names, shapes and a single dtype, from the headers; ValueError naming what is wrong."""
    dtypes = {info.dtype for info in reader.tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"{reader.directory}: mixed tensor dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    expected = expected_hf_tensors(spec, dtype)
    missing = sorted(expected.keys() - reader.tensors.keys())
    extra = sorted(reader.tensors.keys() - expected.keys())
    if missing or extra:
        raise ValueError(
            f"{reader.directory} does not match its config.json: missing tensors {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected tensors {extra[:8]}"
            f"{' ...' if len(extra) > 8 else ''}"
        )
    for name, tensor in expected.items():
        found = reader.tensors[name].shape
        if found != tuple(tensor.shape):
            raise ValueError(
                f"{name}: shape {list(found)} in the checkpoint, {list(tensor.shape)} from "
                f"config.json"
            )
    return dtype


def _progress(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="layer", file=sys.stderr, disable=not enabled)


def hf_to_megatron_checkpoint(
    hf_dir: str | Path, out: str | Path, *, progress: bool = True
) -> ConversionReport:
    """Convert an HF safetensors checkpoint directory into a megatron torch_dist checkpoint."""
    from megatron.core import dist_checkpointing

    hf_dir, out = Path(hf_dir), refuse_existing(out)
    config_text = (hf_dir / "config.json").read_text()
    spec = load_hf_config(json.loads(config_text))
    reader = HFCheckpointReader(hf_dir)
    dtype = check_hf_tensors(spec, reader)
    model = _tp1_model(spec, dtype)
    params = dict(model.named_parameters())
    count = nbytes = 0

    def copy(megatron: dict[str, torch.Tensor]) -> None:
        nonlocal count, nbytes
        for name, tensor in megatron.items():
            params[name].data.copy_(tensor)
            count, nbytes = count + 1, nbytes + tensor.numel() * tensor.element_size()

    with atomic_directory(out) as partial:
        with _progress(spec.num_layers + 1, "hf -> megatron", progress) as bar:
            outer = reader.read(list(outer_pairs(spec).values()))
            copy({meg: outer[hf] for meg, hf in outer_pairs(spec).items()})
            del outer
            for index in range(spec.num_layers):
                layer = reader.read(hf_layer_names(spec, index))
                copy(layer_hf_to_megatron(spec, layer, index))
                del layer
                bar.update()
            bar.set_postfix_str("saving")
            dist_checkpointing.save(model.sharded_state_dict(), str(partial))
            bar.update()
        (partial / HF_CONFIG_NAME).write_text(config_text)
    return ConversionReport(count, nbytes, dtype)


def megatron_dtype(megatron_dir: Path) -> torch.dtype:
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(str(megatron_dir))
    key = "embedding.word_embeddings.weight"
    if key not in metadata:
        raise ValueError(f"{megatron_dir}: no {key} in the checkpoint (not a GPT model?)")
    return metadata[key].dtype


def load_megatron_checkpoint(model: torch.nn.Module, megatron_dir: str | Path) -> None:
    """Load a torch_dist checkpoint into this rank's model (megatron reshards to its layout).

    Every tensor the model asks for must be in the checkpoint and vice versa; a mismatch with
    the config becomes a ValueError naming the tensors, shapes or keys involved.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling

    try:
        loaded = dist_checkpointing.load(
            model.sharded_state_dict(), str(megatron_dir), strict=StrictHandling.RAISE_ALL
        )
    except CheckpointingException as error:
        raise ValueError(f"{megatron_dir} does not match the model config: {error}") from error
    model.load_state_dict(loaded, strict=True)


def _hf_config_text(megatron_dir: Path, hf_config_dir: Path | None) -> str:
    source = hf_config_dir / "config.json" if hf_config_dir else megatron_dir / HF_CONFIG_NAME
    if not source.exists():
        raise FileNotFoundError(
            f"{source} not found: pass --hf-config-dir with the model's config.json"
        )
    return source.read_text()


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
    hf_config_dir = Path(hf_config_dir) if hf_config_dir else None
    out = refuse_existing(out)
    config_text = _hf_config_text(megatron_dir, hf_config_dir)
    spec = load_hf_config(json.loads(config_text))
    dtype = megatron_dtype(megatron_dir)
    model = _tp1_model(spec, dtype)
    load_megatron_checkpoint(model, megatron_dir)
    params = {name: p.detach() for name, p in model.named_parameters()}
    with atomic_directory(out) as partial:
        writer = ShardedSafetensorsWriter(partial, max_shard_bytes)
        # save_pretrained's order: embeddings, layers, final norm, lm_head.
        first, *last = outer_pairs(spec).items()
        with _progress(spec.num_layers, "megatron -> hf", progress) as bar:
            writer.add(first[1], params[first[0]])
            for index in range(spec.num_layers):
                for name, tensor in layer_megatron_to_hf(spec, params, index).items():
                    writer.add(name, tensor)
                bar.update()
            for megatron_name, hf_name in last:
                writer.add(hf_name, params[megatron_name])
            writer.finish()
        (partial / "config.json").write_text(config_text)
        if hf_config_dir:
            _copy_non_weight_files(hf_config_dir, partial)
    return ConversionReport(writer.tensor_count, writer.total_bytes, dtype)


def _copy_non_weight_files(source: Path, destination: Path) -> None:
    """Tokenizer, generation config and the like; weights, indexes and config.json excluded."""
    for path in source.iterdir():
        skip = path.name.endswith((*WEIGHT_SUFFIXES, ".index.json")) or path.name == "config.json"
        if path.is_file() and not skip:
            shutil.copy2(path, destination / path.name)
