"""shared_gguf_parsing: one reader per file and one name map per architecture inside the block, the library's
own functions back outside it (the converted model itself is checked in test_model_loader.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from entropy_experiments.models.gguf_speedups import shared_gguf_parsing


def _tiny_gguf(path) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_inside_the_block_one_reader_and_one_map_serve_every_call(tmp_path):
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    plain = gguf.GGUFReader(path)
    with shared_gguf_parsing():
        first, second = gguf.GGUFReader(path), gguf.GGUFReader(path)
        assert first is second
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1) is not gguf.get_tensor_name_map(
            gguf.MODEL_ARCH.LLAMA, 2)
    # what the shared reader read is what a plain reader reads
    assert [t.name for t in first.tensors] == [t.name for t in plain.tensors] == ["token_embd.weight"]
    assert np.array_equal(first.tensors[0].data, plain.tensors[0].data)
    assert gguf.GGUFReader is original_reader and gguf.get_tensor_name_map is original_map
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_the_library_functions_come_back_after_an_error(tmp_path):
    original_reader = gguf.GGUFReader
    with pytest.raises(RuntimeError), shared_gguf_parsing():
        raise RuntimeError("conversion failed")
    assert gguf.GGUFReader is original_reader


def test_metadata_is_parsed_once_per_path_and_handed_out_as_copies(monkeypatch):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    calls = []

    def fake_load(path, return_tensors=False, **kwargs):
        calls.append((str(path), return_tensors))
        return {"config": {"vocab": ["a", "b"]}, "tensors": {"w": 1} if return_tensors else {}}

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", fake_load)
    with shared_gguf_parsing():
        first = gguf_utils.load_gguf_checkpoint("m.gguf", return_tensors=False)
        first["config"]["vocab"].append("edited by a caller")
        second = gguf_utils.load_gguf_checkpoint("m.gguf", return_tensors=False)
        with_tensors = gguf_utils.load_gguf_checkpoint("m.gguf", return_tensors=True)
    assert second == {"config": {"vocab": ["a", "b"]}, "tensors": {}}
    assert with_tensors["tensors"] == {"w": 1}
    assert calls == [("m.gguf", False), ("m.gguf", True)]  # the metadata once; tensor loads pass through
    assert gguf_utils.load_gguf_checkpoint is fake_load
