"""Tests of axlearn.common.file_system on local paths, file:// URLs and memory:// stores.

Each operation runs on a tree built under a root of each kind and is compared with what
plain Python file operations (os, open, glob) give on the same tree built locally.
"""

import glob as glob_module
import os
import shutil
import uuid

import numpy as np
import pytest
import tensorstore as ts

from axlearn.common import file_system

# Relative file -> contents: files at three depths, names that need percent-encoding in
# a URL, and text with newlines of both kinds.
TREE = {
    "index.json": b'{"step": 3}\r\n',
    "a/x.txt": "caf\u00e9\n".encode(),
    "a/y.txt": b"",
    "a/deep/z.bin": bytes(range(256)),
    "b c%d/q.tok": b"\x00\x01",
    "data-00000.tok": b"0" * 100,
    "data-00001.tok": b"1" * 50,
}


@pytest.fixture(name="root", params=["local", "file_url", "memory"])
def fixture_root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "root")
    if request.param == "file_url":
        return "file://" + str(tmp_path / "root")
    return f"memory://{uuid.uuid4().hex}/root"


def _reference(tmp_path) -> str:
    """TREE written with plain Python file operations."""
    base = str(tmp_path / "reference")
    for name, data in TREE.items():
        path = os.path.join(base, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return base


def _write_tree(root: str) -> None:
    for name, data in TREE.items():
        path = file_system.join(root, *name.split("/"))
        file_system.makedirs(file_system.join(root, *name.split("/")[:-1]))
        file_system.write_bytes(path, data)


def test_written_files_read_back_byte_for_byte(root, tmp_path):
    _write_tree(root)
    reference = _reference(tmp_path)
    for name in TREE:
        with open(os.path.join(reference, name), "rb") as f:
            expected = f.read()
        assert file_system.read_bytes(file_system.join(root, *name.split("/"))) == expected


def test_text_round_trips_without_newline_translation(root):
    path = file_system.join(root, "config.txt")
    file_system.makedirs(root)
    text = "a: 1\r\nb: '\u00e9'\n"
    file_system.write_text(path, text)
    assert file_system.read_text(path) == text


def test_listdir_lists_files_and_directories_like_os_listdir(root, tmp_path):
    _write_tree(root)
    reference = _reference(tmp_path)
    for directory in ["", "a", "a/deep", "b c%d"]:
        expected = sorted(os.listdir(os.path.join(reference, directory)))
        parts = directory.split("/") if directory else []
        assert file_system.listdir(file_system.join(root, *parts)) == expected, directory


def test_listdir_of_a_missing_directory_raises_file_not_found(root):
    with pytest.raises(FileNotFoundError):
        file_system.listdir(file_system.join(root, "missing"))


@pytest.mark.parametrize(
    "pattern", ["*", "*.tok", "data-*.tok", "a/*", "*/*.txt", "[ab]*", "a/?.txt", "zz*", "a/*/*"]
)
def test_glob_matches_what_python_glob_matches(root, tmp_path, pattern):
    _write_tree(root)
    reference = _reference(tmp_path)
    expected = sorted(
        os.path.relpath(p, reference) for p in glob_module.glob(os.path.join(reference, pattern))
    )
    found = file_system.glob(f"{root}/{pattern}")
    assert [file_system.join(root, *name.split("/")) for name in expected] == found


def test_exists_isfile_and_isdir_agree_with_os_path(root, tmp_path):
    _write_tree(root)
    reference = _reference(tmp_path)
    for name in ["index.json", "a", "a/deep", "a/deep/z.bin", "b c%d", "missing", "a/missing"]:
        local = os.path.join(reference, name)
        path = file_system.join(root, *name.split("/"))
        assert file_system.exists(path) == os.path.exists(local), name
        assert file_system.isfile(path) == os.path.isfile(local), name
        assert file_system.isdir(path) == os.path.isdir(local), name


def test_missing_file_raises_file_not_found(root):
    with pytest.raises(FileNotFoundError):
        file_system.read_bytes(file_system.join(root, "missing.json"))


def test_write_replaces_the_whole_file_and_leaves_no_temporary(root):
    _write_tree(root)
    path = file_system.join(root, "index.json")
    file_system.write_bytes(path, b"new")
    assert file_system.read_bytes(path) == b"new"
    assert file_system.listdir(root) == sorted({name.split("/")[0] for name in TREE})


def test_rmtree_deletes_a_directory_and_keeps_its_siblings(root, tmp_path):
    _write_tree(root)
    reference = _reference(tmp_path)
    file_system.rmtree(file_system.join(root, "a"))
    file_system.rmtree(file_system.join(root, "never_existed"))
    shutil.rmtree(os.path.join(reference, "a"))
    assert file_system.listdir(root) == sorted(os.listdir(reference))
    assert not file_system.exists(file_system.join(root, "a", "x.txt"))


def test_remove_deletes_one_file(root):
    _write_tree(root)
    file_system.remove(file_system.join(root, "a", "x.txt"))
    assert file_system.listdir(file_system.join(root, "a")) == ["deep", "y.txt"]


def test_open_append_appends_like_a_file_opened_for_appending(root, tmp_path):
    file_system.makedirs(root)
    path = file_system.join(root, "metrics.jsonl")
    reference = str(tmp_path / "reference.jsonl")
    chunks = [b'{"step": 1}\n', b'{"step": 2}\n', b'{"step": 3}\n']
    for session in (chunks[:2], chunks[2:]):  # A restart appends to the earlier records.
        ours, theirs = file_system.open_append(path), open(reference, "ab")
        for chunk in session:
            ours.write(chunk)
            theirs.write(chunk)
            ours.flush()
        ours.close()
        theirs.close()
    with open(reference, "rb") as f:
        assert file_system.read_bytes(path) == f.read()


def test_fsync_after_flush_keeps_what_was_written(root):
    file_system.makedirs(root)
    path = file_system.join(root, "events")
    f = file_system.open_append(path)
    f.write(b"record")
    f.flush()
    file_system.fsync(f)
    assert file_system.read_bytes(path) == b"record"
    f.close()


def test_kvstore_spec_opens_a_zarr_array_whose_files_are_listed(root):
    directory = file_system.join(root, "arrays", "w")
    file_system.makedirs(directory)
    spec = {
        "driver": "zarr",
        "kvstore": file_system.kvstore_spec(directory),
        "metadata": {"shape": [4, 6], "chunks": [2, 6], "dtype": "<f4", "compressor": None},
    }
    values = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    context = file_system.context()
    ts.open(spec, create=True, open=True, context=context).result().write(values).result()
    assert file_system.listdir(directory) == [".zarray", "0.0", "1.0"]
    raw = file_system.read_bytes(file_system.join(directory, "1.0"))
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4").reshape(2, 6), values[2:])
    read = ts.open(spec, open=True, context=context).result().read().result()
    np.testing.assert_array_equal(read, values)


def test_url_parts_are_percent_encoded_and_names_come_back_decoded():
    root = f"memory://{uuid.uuid4().hex}"
    path = file_system.join(root, "b c%d", "x.txt")
    assert path == f"{root}/b%20c%25d/x.txt"
    file_system.write_bytes(path, b"1")
    assert file_system.listdir(root) == ["b c%d"]
    assert file_system.kvstore_spec(path)["path"].endswith("/b c%d/x.txt")


def test_local_join_is_os_path_join():
    assert file_system.join("run", "checkpoints", "step_1") == os.path.join(
        "run", "checkpoints", "step_1"
    )


def test_file_url_names_the_local_path(tmp_path):
    assert file_system.local_path(f"file://{tmp_path}/a%20b") == f"{tmp_path}/a b"
    assert file_system.kvstore_spec(f"file://{tmp_path}/x") == {
        "driver": "file",
        "path": f"{tmp_path}/x",
    }


def test_s3_urls_take_endpoint_and_region_from_the_aws_variables(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    assert file_system.kvstore_spec("s3://my-bucket/run/checkpoints") == {
        "driver": "s3",
        "bucket": "my-bucket",
        "path": "run/checkpoints",
        "endpoint": "http://127.0.0.1:9",
        "aws_region": "eu-west-1",
    }


def test_gs_urls_name_the_bucket_and_path():
    assert file_system.kvstore_spec("gs://my-bucket/run") == {
        "driver": "gcs",
        "bucket": "my-bucket",
        "path": "run",
    }


def test_url_no_driver_accepts_is_an_error_naming_it():
    with pytest.raises(ValueError, match="nosuch://x/y is not a storage URL"):
        file_system.kvstore_spec("nosuch://x/y")
