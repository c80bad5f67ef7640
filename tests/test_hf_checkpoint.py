"""hf_checkpoint: lazy views of checkpoint tensors, safetensors reading and writing."""

import json
import os

import ml_dtypes
import numpy as np
import pytest

from axlearn.common import hf_checkpoint
from axlearn.common.config import ConfigError
from axlearn.common.hf_checkpoint import ArrayReader, Concat, SplitAxis, Stack, Tensor, Transpose

pytest.importorskip("safetensors")


def _arrays(seed=0):
    rng = np.random.RandomState(seed)
    return {name: rng.randn(*shape).astype(np.float32)
            for name, shape in (("q", (12, 5)), ("k", (4, 5)), ("v", (4, 5)), ("n", (7,)))}


@pytest.mark.parametrize(
    "index",
    [(), (slice(1, 4),), (slice(0, 5), slice(2, 4), slice(1, 2)), (slice(None), slice(3, 5))],
)
def test_a_view_reads_the_slice_of_the_array_it_describes(index):
    arrays = _arrays()
    reader = ArrayReader(arrays)
    heads = lambda name, num: SplitAxis(Transpose(Tensor(reader, name)), 1, (num, 4))
    fused = Concat([heads("q", 3), heads("k", 1), heads("v", 1)], axis=1)
    expected = np.concatenate(
        [arrays[n].T.reshape(5, -1, 4) for n in ("q", "k", "v")], axis=1
    )
    assert fused.shape == expected.shape == (5, 5, 4)
    np.testing.assert_array_equal(fused.read(index), expected[index])


def test_a_stack_reads_only_the_layers_of_its_slice():
    reads = []

    class Counting(ArrayReader):
        def read(self, name, index=()):
            reads.append(name)
            return super().read(name, index)

    reader = Counting({f"layer{i}": np.full((2, 3), i, np.float32) for i in range(4)})
    stacked = Stack([Tensor(reader, f"layer{i}") for i in range(4)])
    np.testing.assert_array_equal(stacked.read((slice(1, 3), slice(0, 1))), [[[1] * 3], [[2] * 3]])
    assert reads == ["layer1", "layer2"]


def test_sharded_safetensors_round_trip_through_the_index(tmp_path):
    arrays = _arrays(seed=1)
    arrays["b"] = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3)
    written = hf_checkpoint.write_safetensors(arrays, str(tmp_path), max_shard_size=200)
    assert hf_checkpoint.SAFETENSORS_INDEX_FILE in written and len(written) > 2
    with open(tmp_path / hf_checkpoint.SAFETENSORS_INDEX_FILE, encoding="utf-8") as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(arrays)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in arrays.values())
    reader = hf_checkpoint.SafetensorsReader(str(tmp_path))
    assert reader.names() == set(arrays)
    for name, value in arrays.items():
        np.testing.assert_array_equal(reader.read(name), value.astype(np.float32), err_msg=name)
    part = reader.read("q", (slice(2, 5), slice(1, 3)))
    np.testing.assert_array_equal(part, arrays["q"][2:5, 1:3])


def test_small_tensors_fit_one_file_without_an_index(tmp_path):
    written = hf_checkpoint.write_safetensors(_arrays(), str(tmp_path), max_shard_size=10**6)
    assert written == [hf_checkpoint.SAFETENSORS_FILE]
    assert hf_checkpoint.SafetensorsReader(str(tmp_path)).shape("q") == (12, 5)


def test_a_directory_without_weights_is_named_in_the_error(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path)):
        hf_checkpoint.SafetensorsReader(str(tmp_path))


@pytest.mark.parametrize(
    "text,size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), ("123", 123)]
)
def test_sizes_are_read_with_their_units(text, size):
    assert hf_checkpoint.parse_size(text) == size


def test_a_tokenizer_json_is_copied_with_its_config(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "my_tokenizer.json").write_text("{}")
    (source / "tokenizer_config.json").write_text("{}")
    written = hf_checkpoint.copy_tokenizer(str(source / "my_tokenizer.json"), str(tmp_path / "out"))
    assert sorted(written) == ["tokenizer.json", "tokenizer_config.json"]
    assert sorted(os.listdir(tmp_path / "out")) == ["tokenizer.json", "tokenizer_config.json"]
