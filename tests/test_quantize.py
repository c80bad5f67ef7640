"""quantize: the artifact round trip bit for bit, damaged files refused in one line, and
generate reading an artifact (its stdout the text alone)."""

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from axlearn.common import generate, quantization, quantize
from axlearn.common.config import ConfigError
from axlearn.common.utils import flatten_with_paths
from tests.fresh_python import REPO, fresh_env


def _params():
    rng = np.random.default_rng(0)
    return {
        "decoder/emb/token_emb/weight": rng.normal(size=(300, 256)).astype(np.float32),
        "decoder/layer/linear1/weight": rng.normal(size=(2, 256, 512)).astype(np.float32),
        "decoder/layer/o_proj/weight": rng.normal(size=(256, 4, 64)).astype(np.float32),
        "decoder/layer/norm/scale": rng.normal(size=(256,)).astype(np.float32),
        "decoder/small/weight": rng.normal(size=(16, 16)).astype(np.float32),
        "step_count": np.arange(3, dtype=np.int32),
    }


@pytest.mark.parametrize("kind", ["int8", "int6"])
def test_the_artifact_reads_back_bit_for_bit(kind):
    flat = _params()
    entries = quantize.quantize_params(flat, kind)
    data = quantize.encode_artifact(entries, quantize=kind, meta=dict(step=7))
    header, read = quantize.decode_artifact(data)
    assert header["meta"] == dict(step=7) and list(read) == list(flat)
    bits = quantization.BITS[kind]
    for path, array in flat.items():
        if path.endswith(("norm/scale", "small/weight", "step_count")):  # Kept as they are.
            assert read[path]["encoding"] == "raw" and read[path]["array"].dtype == array.dtype
            np.testing.assert_array_equal(read[path]["array"], array)
            continue
        axes = quantization.contracted_axes(path, array.ndim)
        q, scale = quantization.quantize(array, bits, axes)
        np.testing.assert_array_equal(read[path]["values"], q)
        assert read[path]["scale"].tobytes() == scale.tobytes()
    deq = dict(flatten_with_paths(quantize.dequantized_params(read)))
    np.testing.assert_array_equal(deq["decoder/layer/norm/scale"], flat["decoder/layer/norm/scale"])


def test_int6_artifacts_are_smaller_than_int8_ones():
    flat = _params()
    sizes = {
        kind: len(quantize.encode_artifact(quantize.quantize_params(flat, kind), quantize=kind))
        for kind in ("int8", "int6")
    }
    raw_int8 = sum(a.size for p, a in flat.items() if a.size >= quantization.MIN_QUANTIZED_SIZE)
    assert sizes["int6"] < 0.8 * sizes["int8"] and sizes["int8"] < raw_int8


def _artifact_bytes():
    flat = {"decoder/layer/linear1/weight": _params()["decoder/layer/linear1/weight"]}
    return quantize.encode_artifact(quantize.quantize_params(flat, "int8"), quantize="int8")


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d[: len(d) - 10], r"^a\.axq: truncated \(\d+ bytes, expected \d+\)$"),
        (lambda d: d[:12], r"^a\.axq: truncated \(12 bytes, in its header\)$"),
        (lambda d: d[:60], r"^a\.axq: truncated \(60 bytes; its header alone needs \d+\)$"),
        (lambda d: b"PK\x03\x04" + d[4:], r"^a\.axq: not a quantized artifact \(it starts with"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), r"^a\.axq: damaged \(its payload's sha256"),
    ],
)
def test_a_damaged_or_foreign_file_is_refused_in_one_line(damage, message):
    with pytest.raises(quantize.ArtifactError, match=message):
        quantize.decode_artifact(damage(_artifact_bytes()), source="a.axq")


def test_an_artifact_that_does_not_fit_the_model_is_one_line():
    _, entries = quantize.decode_artifact(_artifact_bytes())

    class Spec:
        shape = (2, 256, 256)

    with pytest.raises(ConfigError, match=r"^a: decoder/layer/linear1/weight has shape "
                       r"\(2, 256, 512\), the model's is \(2, 256, 256\)$"):
        quantize.check_matches(entries, {"decoder": {"layer": {"linear1": {"weight": Spec()}}}},
                               source="a")


def _write_llama_artifact(path, kind="int8"):
    """A random tiny Llama (vocab 300, bytes tokenizer) as an artifact."""
    import jax  # pylint: disable=import-outside-toplevel

    from tools import generate_bench  # pylint: disable=import-outside-toplevel

    cfg = generate_bench.llama_config("64x2x4x2x128x300")
    cfg.dtype = np.float32
    mesh = generate.make_mesh(1)
    params = jax.device_get(generate_bench.random_params(cfg, mesh))
    flat = {p: np.asarray(x) * 10 for p, x in flatten_with_paths(params)}  # Std 0.2.
    entries = quantize.quantize_params(flat, kind, min_size=4096)
    meta = dict(step=1, model_config=cfg.debug_string(), tokenizer="bytes")
    path.write_bytes(quantize.encode_artifact(entries, quantize=kind, meta=meta))
    return entries


@pytest.mark.slow
def test_generate_prints_an_artifacts_text_alone_on_stdout_and_its_speed_on_stderr(tmp_path):
    path = tmp_path / "m.axq"
    _write_llama_artifact(path)
    fv = generate.parse_flags([
        f"--artifact={path}", "--prompt=ab", "--prompt=cde", "--max_new_tokens=5",
        "--batch_size=2", "--dtype=float32", "--eos_id=299", "--quantize=int8",
    ])
    out, err = io.StringIO(), io.StringIO()
    stats = generate.run(fv, out=out, err=err)
    texts = out.getvalue().split("\n\n")
    assert texts[0].startswith("ab") and texts[1].startswith("cde") and texts[2] == ""
    assert "tokens/s" not in out.getvalue()
    assert err.getvalue().startswith(f"{stats.new_tokens} tokens generated in ")


@pytest.mark.slow
def test_int8_decoding_of_an_artifact_agrees_with_its_dequantized_weights(tmp_path):
    path = tmp_path / "m.axq"
    _write_llama_artifact(path)
    prompts = [[1, 2, 3, 4], [9, 8]]
    outputs = {}
    for kind in ("int8", None):
        generator, _ = generate.from_artifact(str(path), dtype="float32", quantize=kind)
        generator.set_eos_ids([299])
        assert generator.quantized == (kind == "int8")
        outputs[kind], _ = generator.generate(prompts, max_new_tokens=12, batch_size=2)
    assert outputs["int8"] == outputs[None]


@pytest.mark.slow
def test_the_generate_command_refuses_an_unsupported_quantize_value_in_one_line(tmp_path):
    path = tmp_path / "m.axq"
    path.write_bytes(_artifact_bytes()[:40])
    for flag, message in [
        ("--quantize=int4", "generate: --quantize='int4' is not supported for decoding: "
                            "choose int8 (an int6 --artifact decodes dequantized without "
                            "--quantize)"),
        ("--quantize=int8", f"generate: {path}: truncated (40 bytes; its header alone needs"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "axlearn.common.generate", f"--artifact={path}",
             "--prompt=a", flag],
            cwd=REPO, env=fresh_env(1), capture_output=True, text=True, timeout=300,
            check=False,
        )
        assert result.returncode != 0 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr[-2000:]


@pytest.mark.slow
def test_export_then_eval_only_and_generate_read_the_artifact(tmp_path):
    # pylint: disable-next=import-outside-toplevel
    from tests.test_launch import TINY_RUN, _main

    run_dir, artifact = tmp_path / "run", tmp_path / "m.axq"
    trained = _main(*TINY_RUN, f"--trainer_dir={run_dir}", "--config_override=max_step=2")
    assert trained.returncode == 0, trained.stderr[-3000:]

    def command(module, *args):
        return subprocess.run(
            [sys.executable, "-m", module, *args], cwd=REPO, env=fresh_env(1),
            capture_output=True, text=True, timeout=600, check=False,
        )

    export = command("axlearn.common.quantize", "export", f"--trainer_dir={run_dir}",
                     "--quantize=int6", "--min_size=1024", f"--output={artifact}")
    assert export.returncode == 0, export.stderr[-3000:]
    summary, row = (json.loads(line) for line in export.stdout.splitlines()[-2:])
    assert summary["bytes"] == artifact.stat().st_size and summary["quantized_tensors"] > 0
    assert row["quantized_loss"] != row["loss"] and abs(row["quantized_loss"] - row["loss"]) < 0.1
    evaluated = command("axlearn.common.launch_trainer_main", *TINY_RUN[:-2], "--eval_only",
                        f"--artifact={artifact}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout.splitlines()[-1])["loss"] == row["quantized_loss"]
    generated = command("axlearn.common.generate", f"--artifact={artifact}", "--prompt=hi",
                        "--tokenizer=bytes", "--max_new_tokens=3")
    assert generated.returncode == 0 and generated.stdout.startswith("hi"), generated.stderr[-3000:]
