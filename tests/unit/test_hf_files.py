"""HF checkpoint files: the header reader agrees with safetensors' own, the index decides which
copy of a tensor is read, and broken files are refused with the file and the fault named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_fr.convert.hf_files import ShardedSafetensorsWriter
from megatron_fr.utils.hf_checkpoint import INDEX_NAME, HFCheckpointReader
from megatron_fr.utils.safetensors_io import TensorFile, read_header


def sample_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(6, 5, generator=generator).to(torch.bfloat16),
        "b.bias": torch.randn(7, generator=generator),
        "c.weight": torch.randn(3, 4, 2, generator=generator).to(torch.float16),
        "d.scalar": torch.tensor(3.5, dtype=torch.float64),
    }


def test_header_and_reads_match_safetensors(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(sample_tensors(), path, metadata={"format": "pt"})
    entries = read_header(path)
    with safe_open(path, framework="pt") as handle:
        assert sorted(entries) == sorted(handle.keys())
        for name, entry in entries.items():
            view = handle.get_slice(name)
            assert entry.shape == tuple(view.get_shape()), name
    expected = load_file(path)
    with HFCheckpointReader(tmp_path) as reader:
        for name, tensor in reader.read(sorted(expected)).items():
            assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name])
        file, entry = reader.file("a.weight")
        rows = torch.empty(3, 5, dtype=torch.float32)  # converted on the way, as copy_ does
        file.read_rows(entry, 2, 5, rows)
        assert torch.equal(rows, expected["a.weight"][2:5].float())
        columns = torch.empty(6, 2, dtype=torch.bfloat16)
        file.read_columns(entry, 1, 3, columns)
        assert torch.equal(columns, expected["a.weight"][:, 1:3])


def write_two_shards_with_a_duplicate(directory, index_says: str | None) -> None:
    save_file(
        {"x": torch.zeros(4), "y": torch.ones(2)}, directory / "model-00001-of-00002.safetensors"
    )
    save_file({"x": torch.full((4,), 7.0)}, directory / "model-00002-of-00002.safetensors")
    if index_says:
        weight_map = {"x": index_says, "y": "model-00001-of-00002.safetensors"}
        (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize(
    "chosen", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
)
def test_the_index_decides_which_copy_of_a_duplicated_tensor_is_read(tmp_path, chosen):
    write_two_shards_with_a_duplicate(tmp_path, index_says=chosen)
    with HFCheckpointReader(tmp_path) as reader:
        assert reader.tensors["x"].file.name == chosen
        expected = load_file(tmp_path / chosen)["x"]
        assert torch.equal(reader.read(["x"])["x"], expected)


def test_a_duplicated_tensor_without_index_is_refused_naming_both_files(tmp_path):
    write_two_shards_with_a_duplicate(tmp_path, index_says=None)
    with pytest.raises(ValueError) as error:
        HFCheckpointReader(tmp_path)
    message = str(error.value)
    assert "x is in both model-00001-of-00002.safetensors and model-00002-of-00002" in message
    assert f"no {INDEX_NAME}" in message


def test_index_inconsistencies_are_named(tmp_path):
    save_file({"x": torch.zeros(4), "z": torch.zeros(1)}, tmp_path / "a.safetensors")
    index = tmp_path / INDEX_NAME
    index.write_text(json.dumps({"weight_map": {"x": "a.safetensors", "w": "a.safetensors"}}))
    with pytest.raises(ValueError, match=f"{INDEX_NAME} maps w to a.safetensors, which does not"):
        HFCheckpointReader(tmp_path)
    index.write_text(json.dumps({"weight_map": {"x": "a.safetensors"}}))
    with pytest.raises(ValueError, match=r"a.safetensors holds tensors .* does not list: \['z'\]"):
        HFCheckpointReader(tmp_path)
    index.write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"gone\.safetensors is listed"):
        HFCheckpointReader(tmp_path)


def corrupt_variants(good: bytes) -> dict[str, tuple[bytes, str]]:
    header_length = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + header_length])
    first = next(name for name in header if name != "__metadata__")
    bad_dtype = dict(header, **{first: dict(header[first], dtype="I4")})
    bad_range = dict(header, **{first: dict(header[first], data_offsets=[0, 3])})

    def with_header(new: dict) -> bytes:
        text = json.dumps(new).encode()
        return len(text).to_bytes(8, "little") + text + good[8 + header_length :]

    return {
        "truncated data": (good[:-10], "declares .* bytes of tensors, the file holds"),
        "truncated header": (good[:40], "header length .* does not fit in the file"),
        "empty": (b"", "too short to hold the 8-byte header length"),
        "not json": (
            good[:8] + b"\xff" * header_length + good[8 + header_length :],
            "not valid JSON",
        ),
        "trailing bytes": (good + b"\0" * 16, "16 bytes after the last tensor"),
        "bad dtype": (with_header(bad_dtype), f"tensor {first} has unsupported dtype I4"),
        "bad range": (
            with_header(bad_range),
            f"tensor {first}: byte range \\[0, 3\\) does not hold",
        ),
    }


def test_corrupt_files_are_refused_naming_file_and_fault(tmp_path):
    good_path = tmp_path / "good.safetensors"
    save_file(sample_tensors(), good_path)
    for case, (content, message) in corrupt_variants(good_path.read_bytes()).items():
        directory = tmp_path / case.replace(" ", "_")
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(content)
        with pytest.raises(ValueError, match=message) as error:
            HFCheckpointReader(directory)
        assert str(directory / "model.safetensors") in str(error.value), case


def test_a_file_cut_short_after_opening_is_named_at_read_time(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"big": torch.zeros(1000)}, path)
    entry = read_header(path)["big"]
    with open(path, "r+b") as handle:
        handle.truncate(entry.offset + 100)
    file = TensorFile(path)
    with pytest.raises(ValueError, match=f"{path}: ended at byte {entry.offset + 100}"):
        file.read_rows(entry, 0, 1000, torch.empty(1000))
    file.close()


def test_writer_shards_and_index_load_with_safetensors(tmp_path):
    tensors = sample_tensors()
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=64)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    paths = writer.finish()
    assert [p.name for p in paths] == [
        f"model-0000{i}-of-0000{len(paths)}.safetensors" for i in range(1, len(paths) + 1)
    ]
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    for name, file in index["weight_map"].items():
        assert torch.equal(load_file(tmp_path / file)[name], tensors[name])
