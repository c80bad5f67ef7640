"""Specification of `python -m axlearn.common.input_tokens build`: tokenizers, input files,
parallel and atomic writing, validation splits, and the vocabulary manifest of shards."""

import gzip
import hashlib
import io
import json
import os
import random
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from axlearn.common.input_base import InputError
from axlearn.common.input_token_format import (
    HEADER_SIZE,
    TokenShard,
    TokenShardError,
    VocabularyRecord,
)
from axlearn.common import input_tokens
from axlearn.common.input_tokens import TokenShardInput, build_splits, main
from axlearn.common.input_vocab import VocabularyError, load_vocabulary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jam".split()


def _texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(count)]


def _train_sentencepiece(path, **ids):
    sentencepiece = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_texts(300, seed=0)),
        model_writer=model,
        vocab_size=60,
        hard_vocab_limit=False,
        minloglevel=2,
        **ids,
    )
    path.write_bytes(model.getvalue())
    return str(path)


def _train_bpe(path, *, special_tokens, template=None):
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=120, special_tokens=special_tokens, show_progress=False
    )
    tokenizer.train_from_iterator(_texts(300, seed=0), trainer)
    if template is not None:
        bos, eos = template
        tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{bos} $A {eos}",
            special_tokens=[(t, tokenizer.token_to_id(t)) for t in (bos, eos)],
        )
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture(name="llama_spm", scope="module")
def fixture_llama_spm(tmp_path_factory):
    """SentencePiece's default ids, as Llama's: unk 0, bos 1, eos 2, no pad."""
    return _train_sentencepiece(tmp_path_factory.mktemp("spm") / "llama_style.model")


@pytest.fixture(name="t5_spm", scope="module")
def fixture_t5_spm(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "t5_style.model"
    return _train_sentencepiece(path, pad_id=0, eos_id=1, unk_id=2, bos_id=-1)


def _write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts), encoding="utf-8")
    return str(path)


def _documents(path) -> list[list[int]]:
    """A shard's documents as token lists, each ending with its eos."""
    shard = TokenShard(str(path))
    starts = np.concatenate([[0], shard.doc_ends[:-1]]).astype(int)
    return [shard.tokens[s:e].tolist() for s, e in zip(starts, shard.doc_ends)]


def _byte_ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode("utf-8")] + [1]  # The byte vocabulary, then eos 1.


def _listing(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


# ----- tokenizers -----


@pytest.mark.parametrize("model", ["llama_spm", "t5_spm"])
def test_sentencepiece_shards_hold_sentencepiece_ids_and_its_eos(tmp_path, model, request):
    sentencepiece = pytest.importorskip("sentencepiece")
    model_file = request.getfixturevalue(model)
    texts = _texts(20, seed=1)
    inputs = _write_jsonl(tmp_path / "in.jsonl", texts)
    main(["build", f"--vocab={model_file}", f"--output={tmp_path}/out/train", inputs])
    reference = sentencepiece.SentencePieceProcessor(model_file=model_file)
    expected = [reference.encode(t) + [reference.eos_id()] for t in texts]
    assert _documents(tmp_path / "out" / "train-00000.tok") == expected


def test_sentencepiece_manifest_records_the_models_ids_and_checksum(tmp_path, llama_spm):
    sentencepiece = pytest.importorskip("sentencepiece")
    inputs = _write_jsonl(tmp_path / "in.jsonl", _texts(5, seed=2))
    main(["build", f"--vocab={llama_spm}", f"--output={tmp_path}/train", inputs])
    reference = sentencepiece.SentencePieceProcessor(model_file=llama_spm)
    with open(llama_spm, "rb") as f:
        sha256 = hashlib.sha256(f.read()).hexdigest()
    assert TokenShard(str(tmp_path / "train-00000.tok")).vocabulary == VocabularyRecord(
        name="llama_style.model",
        size=reference.get_piece_size(),
        eos_id=2,
        kind="sentencepiece",
        sha256=sha256,
        bos_id=1,
        pad_id=-1,
    )


def test_huggingface_tokenizer_json_shards_hold_its_ids_and_eos(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    path = _train_bpe(tmp_path / "tokenizer.json", special_tokens=["<unk>", "<s>", "</s>"])
    texts = _texts(20, seed=3)
    inputs = _write_jsonl(tmp_path / "in.jsonl", texts)
    main(["build", f"--vocab={path}", f"--output={tmp_path}/out/train", inputs])
    reference = tokenizers.Tokenizer.from_file(path)
    eos = reference.token_to_id("</s>")
    expected = [reference.encode(t, add_special_tokens=False).ids + [eos] for t in texts]
    assert _documents(tmp_path / "out" / "train-00000.tok") == expected
    record = TokenShard(str(tmp_path / "out" / "train-00000.tok")).vocabulary
    assert (record.kind, record.eos_id, record.bos_id) == ("huggingface", eos, 1)
    assert record.size == reference.get_vocab_size(with_added_tokens=True)


def test_huggingface_special_tokens_come_from_the_post_processor_template(tmp_path):
    specials = ["<unk>", "<|start|>", "<|stop|>"]
    path = _train_bpe(
        tmp_path / "tokenizer.json", special_tokens=specials, template=("<|start|>", "<|stop|>")
    )
    vocab = load_vocabulary(path, any_special_ids=True)
    assert (vocab.bos_id, vocab.eos_id) == (1, 2)


def test_huggingface_tokenizer_config_beside_the_file_names_eos(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    _train_bpe(directory / "tokenizer.json", special_tokens=["<unk>", "</s>", "<|end|>"])
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    vocab = load_vocabulary(str(directory), any_special_ids=True)  # The directory's tokenizer.
    assert vocab.eos_id == 2 and vocab.kind == "huggingface"


def test_huggingface_tokenizer_without_a_known_eos_needs_eos_token(tmp_path):
    path = _train_bpe(tmp_path / "tokenizer.json", special_tokens=["<unk>", "<|stop|>"])
    with pytest.raises(VocabularyError, match=r"tokenizer.json: cannot tell .* --eos_token"):
        load_vocabulary(path, any_special_ids=True)
    assert load_vocabulary(path, any_special_ids=True, eos_token="<|stop|>").eos_id == 1


def test_file_that_is_no_sentencepiece_model_is_named(tmp_path):
    path = tmp_path / "vocab.model"
    path.write_text("not a model")
    with pytest.raises(VocabularyError, match=r"vocab.model: not a SentencePiece model"):
        load_vocabulary(str(path), any_special_ids=True)


# ----- input files -----


def _write_input(tmp_path, kind: str, texts: list[str]) -> str:
    lines = "".join(json.dumps({"body": t}) + "\n" for t in texts).encode("utf-8")
    if kind == "txt":
        assert len(texts) == 1
        path = tmp_path / "doc.txt"
        path.write_text(texts[0], encoding="utf-8")
    elif kind == "jsonl":
        path = tmp_path / "docs.jsonl"
        path.write_bytes(lines)
    elif kind == "jsonl.gz":
        path = tmp_path / "docs.jsonl.gz"
        path.write_bytes(gzip.compress(lines))
    elif kind == "jsonl.zst":
        zstandard = pytest.importorskip("zstandard")
        path = tmp_path / "docs.jsonl.zst"
        path.write_bytes(zstandard.ZstdCompressor().compress(lines))
    else:
        pyarrow = pytest.importorskip("pyarrow")
        import pyarrow.parquet  # pylint: disable=import-outside-toplevel

        path = tmp_path / "docs.parquet"
        table = pyarrow.table({"id": list(range(len(texts))), "body": texts})
        pyarrow.parquet.write_table(table, str(path), row_group_size=2)
    return str(path)


@pytest.mark.parametrize("kind", ["txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet"])
def test_each_input_kind_gives_its_documents(tmp_path, kind):
    texts = ["héllo\nwörld"] if kind == "txt" else ["one", "twö", "three 🙂", "four", "five"]
    path = _write_input(tmp_path, kind, texts)
    main(["build", "--text_field=body", f"--output={tmp_path}/out/train", path])
    assert _documents(tmp_path / "out" / "train-00000.tok") == [_byte_ids(t) for t in texts]


# ----- bad input: one clear error, nothing written -----


def _bad_jsonl(tmp_path, second_line: bytes) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' + second_line + b"\n")
    return str(path)


@pytest.mark.parametrize(
    "second_line,message",
    [
        (b'{"text": "caf\xe9"}', r"bad.jsonl:2: not UTF-8 text \(byte 0xe9 at column 14\)"),
        (b'{"text": "unterminated', r"bad.jsonl:2: not a JSON line"),
        (b'{"body": "x"}', r"bad.jsonl:2: expected an object with a string field 'text'"),
    ],
)
def test_bad_json_line_is_named_and_nothing_is_written(tmp_path, second_line, message):
    good = _write_jsonl(tmp_path / "good.jsonl", _texts(50, seed=4))
    bad = _bad_jsonl(tmp_path, second_line)
    with pytest.raises(InputError, match=message):
        # Small shards: several are written before the bad line is reached.
        main(["build", "--tokens_per_shard=100", f"--output={tmp_path}/out/train", good, bad])
    assert _listing(tmp_path / "out") == []


def test_bad_parquet_row_is_named(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet  # pylint: disable=import-outside-toplevel

    path = str(tmp_path / "docs.parquet")
    pyarrow.parquet.write_table(pyarrow.table({"text": ["a", None, "c"]}), path)
    with pytest.raises(InputError, match=r"docs.parquet: row 1: column 'text' is null"):
        main(["build", f"--output={tmp_path}/out/train", path])
    with pytest.raises(InputError, match=r"docs.parquet: no column 'body' \(columns: \['text'\]\)"):
        main(["build", "--text_field=body", f"--output={tmp_path}/out/train", path])
    assert _listing(tmp_path / "out") == []


def test_non_utf8_text_file_names_its_line(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"first line\nsecond \xff line\n")
    with pytest.raises(InputError, match=r"a.txt:2: not UTF-8 text \(byte 0xff at column 8\)"):
        main(["build", f"--output={tmp_path}/out/train", str(path)])


def test_corrupt_gzip_is_named(tmp_path):
    path = tmp_path / "docs.jsonl.gz"
    path.write_bytes(b"this is not gzip data")
    with pytest.raises(InputError, match=r"docs.jsonl.gz:1: cannot read"):
        main(["build", f"--output={tmp_path}/out/train", str(path)])


def test_empty_input_is_refused_naming_the_inputs(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(InputError, match=r"No documents in .*empty.jsonl"):
        main(["build", f"--output={tmp_path}/out/train", str(empty)])
    blank = _write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(InputError, match=r"blank.jsonl \(2 read\) gives the train split any token"):
        main(["build", f"--output={tmp_path}/out/train", blank])
    assert _listing(tmp_path / "out") == []


def test_interrupted_build_leaves_nothing_behind(tmp_path):
    def documents():
        for text in _texts(100, seed=5):
            yield text, "train"
        raise KeyboardInterrupt

    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("not ours")
    with pytest.raises(KeyboardInterrupt):
        build_splits(
            documents(),
            vocab=load_vocabulary("bytes"),
            prefixes={"train": str(output / "train")},
            tokens_per_shard=200,
        )
    assert _listing(output) == ["keep.txt"]


@pytest.mark.slow
def test_command_reports_bad_input_in_one_line_and_fails(tmp_path):
    bad = _bad_jsonl(tmp_path, b"[1, 2]")
    result = subprocess.run(
        [sys.executable, "-m", "axlearn.common.input_tokens", "build"]
        + [f"--output={tmp_path}/out/train", bad],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: {bad}:2: expected an object with a string field 'text' (found no object); "
        "choose the field with --text_field"
    ]
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_the_command_off_a_terminal_prints_no_blank_line_and_ends_with_its_throughput(tmp_path):
    texts = _texts(700, seed=5)
    inputs = _write_jsonl(tmp_path / "in.jsonl", texts)
    result = subprocess.run(
        [sys.executable, "-m", "axlearn.common.input_tokens", "build", "--num_workers=2",
         "--validation_fraction=0.1", f"--output={tmp_path}/out/", inputs],
        capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for stream in (result.stdout, result.stderr):
        assert stream.endswith("\n") and "" not in stream[:-1].split("\n")
    tokens = sum(len(_byte_ids(text)) for text in texts)
    assert result.stderr.splitlines()[-1].startswith(f"tokenized: {tokens:,} tokens, ")


# ----- every core, same bytes -----


def test_build_with_several_workers_equals_one_worker(tmp_path, llama_spm):
    inputs = _write_jsonl(tmp_path / "in.jsonl", _texts(700, seed=6))  # Several worker tasks.
    outputs = {}
    for workers in (1, 2):
        directory = tmp_path / f"w{workers}"
        main(
            ["build", f"--vocab={llama_spm}", f"--num_workers={workers}"]
            + ["--tokens_per_shard=2000", "--validation_fraction=0.2", f"--output={directory}/"]
            + [inputs]
        )
        outputs[workers] = {name: (directory / name).read_bytes() for name in _listing(directory)}
    assert len(outputs[1]) > 2  # Shards of both splits.
    assert outputs[2] == outputs[1]


def test_rebuild_replaces_the_older_shards_of_its_prefix(tmp_path):
    inputs = _write_jsonl(tmp_path / "in.jsonl", _texts(40, seed=7))
    other = tmp_path / "out" / "other-00005.tok"
    main(["build", "--tokens_per_shard=100", f"--output={tmp_path}/out/train", inputs])
    assert len(_listing(tmp_path / "out")) > 2
    other.write_bytes(b"another prefix's file")
    main(["build", "--overwrite", f"--output={tmp_path}/out/train", inputs])
    assert _listing(tmp_path / "out") == ["other-00005.tok", "train-00000.tok"]


def test_build_into_an_output_holding_shards_is_refused_without_overwrite(tmp_path):
    inputs = _write_jsonl(tmp_path / "in.jsonl", _texts(10, seed=7))
    main(["build", f"--output={tmp_path}/out/", inputs])
    before = (tmp_path / "out" / "train-00000.tok").read_bytes()
    other = _write_jsonl(tmp_path / "other.jsonl", _texts(10, seed=8))
    with pytest.raises(InputError, match=r"already holds the shards of a build .*--overwrite"):
        main(["build", f"--output={tmp_path}/out/", other])
    assert (tmp_path / "out" / "train-00000.tok").read_bytes() == before


def test_overwrite_also_removes_the_old_validation_split(tmp_path):
    inputs = _write_jsonl(tmp_path / "in.jsonl", _texts(10, seed=7))
    held_out = _write_jsonl(tmp_path / "held.jsonl", _texts(5, seed=9))
    main(["build", f"--output={tmp_path}/out/", inputs, "--validation_files", held_out])
    assert _listing(tmp_path / "out") == ["train-00000.tok", "validation-00000.tok"]
    texts = _texts(10, seed=8)
    main(["build", "--overwrite", f"--output={tmp_path}/out/", _write_jsonl(tmp_path / "b.jsonl", texts)])
    assert _listing(tmp_path / "out") == ["train-00000.tok"]
    assert _documents(tmp_path / "out" / "train-00000.tok") == [_byte_ids(t) for t in texts]


# ----- validation splits -----


def _share(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0**64


def test_validation_fraction_splits_by_document_hash(tmp_path):
    texts = sorted(set(_texts(200, seed=8)))
    inputs = _write_jsonl(tmp_path / "in.jsonl", texts)
    main(["build", "--validation_fraction=0.25", f"--output={tmp_path}/out/", inputs])
    validation = [t for t in texts if _share(t) < 0.25]
    assert 0 < len(validation) < len(texts)
    assert _documents(tmp_path / "out" / "validation-00000.tok") == [
        _byte_ids(t) for t in validation
    ]
    train = [t for t in texts if _share(t) >= 0.25]
    assert _documents(tmp_path / "out" / "train-00000.tok") == [_byte_ids(t) for t in train]


def test_validation_files_form_the_validation_split_beside_the_train_prefix(tmp_path):
    train, held_out = _texts(30, seed=9), _texts(10, seed=10)
    train_file = _write_jsonl(tmp_path / "train.jsonl", train)
    validation_file = _write_jsonl(tmp_path / "valid.jsonl", held_out)
    main(
        ["build", f"--output={tmp_path}/golf/train", train_file]
        + ["--validation_files", validation_file]
    )
    # The layout golf_baseline reads: data/golf/train-*.tok and data/golf/validation-*.tok.
    assert _listing(tmp_path / "golf") == ["train-00000.tok", "validation-00000.tok"]
    assert _documents(tmp_path / "golf" / "train-00000.tok") == [_byte_ids(t) for t in train]
    assert _documents(tmp_path / "golf" / "validation-00000.tok") == [
        _byte_ids(t) for t in held_out
    ]


# ----- the manifest at training time -----


def test_model_vocab_smaller_than_the_shards_vocabulary_names_both_sizes(tmp_path, llama_spm):
    inputs = _write_jsonl(tmp_path / "in.jsonl", _texts(20, seed=11))
    main(["build", f"--vocab={llama_spm}", f"--output={tmp_path}/train", inputs])
    shard = str(tmp_path / "train-00000.tok")
    size = TokenShard(shard).vocabulary.size
    cfg = TokenShardInput.default_config().set(
        name="input",
        is_training=True,
        global_batch_size=2,
        max_sequence_length=8,
        paths=[shard],
        model_vocab_size=size - 1,
    )
    message = (
        rf"train-00000.tok: vocabulary 'llama_style.model' has {size} ids, more than the model's "
        rf"vocab_size {size - 1}; raise the model's with "
        rf"--config_override=model\.decoder\.vocab_size={size} \(or larger\), or build the "
        r"shards with the model's vocabulary$"
    )
    with pytest.raises(TokenShardError, match=message):
        cfg.instantiate(parent=None)


def test_version_1_shards_without_a_manifest_are_still_read(tmp_path):
    main(["build", f"--output={tmp_path}/train", _write_jsonl(tmp_path / "in.jsonl", ["ab"])])
    data = bytearray((tmp_path / "train-00000.tok").read_bytes())
    (manifest_size,) = struct.unpack_from("<I", data, 108)
    del data[len(data) - manifest_size :]
    struct.pack_into("<I", data, 8, 1)  # Version 1: no manifest size, no manifest.
    struct.pack_into("<I", data, 108, 0)
    struct.pack_into("<I", data, 40, zlib.crc32(data[HEADER_SIZE:]))
    struct.pack_into("<I", data, 124, zlib.crc32(data[:124]))
    old = tmp_path / "old.tok"
    old.write_bytes(bytes(data))
    shard = TokenShard(str(old))
    assert shard.tokens.tolist() == _byte_ids("ab")
    assert shard.vocabulary == VocabularyRecord(
        name="bytes", size=259, eos_id=1, kind="bytes", pad_id=0
    )


# ----- what a long build tells, and the tokenizer it leaves beside the shards -----


def test_a_build_off_a_terminal_prints_progress_lines_counting_its_tokens(tmp_path, monkeypatch):
    monkeypatch.setattr(input_tokens, "PROGRESS_INTERVAL_S", 0.0)  # A line per chunk.
    monkeypatch.delenv("AXLEARN_PROGRESS_BARS", raising=False)
    stream = io.StringIO()  # No terminal: lines, not a bar.
    texts = _texts(600, seed=7)  # More than one chunk of documents.
    summary = build_splits(
        ((text, "train") for text in texts),
        vocab=load_vocabulary("bytes"),
        prefixes={"train": str(tmp_path / "train")},
        progress=True,
        progress_stream=stream,
    )
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 3 and all(line.startswith("tokenizing: ") for line in lines[:-1])
    tokens = sum(len(_byte_ids(text)) for text in texts)  # Each with its EOS.
    assert lines[-2].startswith(f"tokenizing: {tokens:,} tokens, ")


def test_a_build_off_a_terminal_ends_with_its_throughput_and_no_blank_line(tmp_path, monkeypatch):
    monkeypatch.delenv("AXLEARN_PROGRESS_BARS", raising=False)
    stream = io.StringIO()  # No terminal; no line before the interval.
    texts = _texts(50, seed=3)
    build_splits(
        ((text, "train") for text in texts),
        vocab=load_vocabulary("bytes"),
        prefixes={"train": str(tmp_path / "train")},
        progress=True,
        progress_stream=stream,
    )
    tokens = sum(len(_byte_ids(text)) for text in texts)
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert text.startswith(f"tokenized: {tokens:,} tokens, ") and " tok/s, " in text
    assert f", {len(texts):,} documents, " in text


@pytest.mark.slow
def test_the_build_command_stores_its_tokenizer_where_a_run_finds_it(tmp_path):
    pytest.importorskip("tokenizers")
    from axlearn.common import trainer_dir  # pylint: disable=import-outside-toplevel
    from axlearn.common.launch_trainer import (  # pylint: disable=import-outside-toplevel
        build_trainer_config,
    )

    (tmp_path / "tok").mkdir()
    tokenizer = _train_bpe(tmp_path / "tok" / "tokenizer.json", special_tokens=["<unk>", "</s>"])
    inputs = _write_jsonl(tmp_path / "in.jsonl", _texts(40, seed=4))
    result = subprocess.run(
        [sys.executable, "-m", "axlearn.common.input_tokens", "build", f"--vocab={tokenizer}",
         f"--output={tmp_path}/data/train", "--validation_fraction=0.2", inputs],
        capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    stored = tmp_path / "data" / "tokenizer.json"
    assert f"{stored}: the shards' tokenizer" in result.stdout
    with open(tokenizer, "rb") as f:
        assert stored.read_bytes() == f.read()
    # A run on the shards, its config read back as generate and export read it.
    vocab_size = TokenShard(str(tmp_path / "data" / "train-00000.tok")).header.vocab_size
    cfg = build_trainer_config(
        config_name="gpt_test", data_dir=str(tmp_path / "data"),
        config_overrides=[f"model.decoder.vocab_size={vocab_size}"],
    )
    assert trainer_dir.recorded_tokenizer(cfg) == str(stored)


def test_a_different_file_of_the_tokenizers_name_beside_the_shards_stops_the_build(tmp_path):
    pytest.importorskip("tokenizers")
    (tmp_path / "tok").mkdir()
    tokenizer = _train_bpe(tmp_path / "tok" / "tokenizer.json", special_tokens=["<unk>", "</s>"])
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tokenizer.json").write_text("{}")
    inputs = _write_jsonl(tmp_path / "in.jsonl", _texts(5, seed=4))
    with pytest.raises(InputError, match="another tokenizer file of that name"):
        main(["build", f"--vocab={tokenizer}", f"--output={tmp_path}/data/train", inputs])
    assert _listing(tmp_path / "data") == ["tokenizer.json"]  # Refused before any shard.
