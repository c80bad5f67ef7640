"""tools/peft_bench.py: the transformers + PEFT LoRA peer, its counts against the published
ones, and a tiny run on the CPU printing bench's columns beside ours."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.fresh_python import REPO, fresh_env

_SPEC = importlib.util.spec_from_file_location(
    "peft_bench", os.path.join(REPO, "tools", "peft_bench.py")
)
peft_bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(peft_bench)


@pytest.mark.parametrize(
    "shape,total,trainable",
    [
        # transformers' parameter counts of Llama 2 7B and Llama 3 8B, and the trainable
        # parameters PEFT prints for LoRA r=16 on all seven linear maps of each.
        ("llama2_7b", 6_738_415_616, 39_976_960),
        ("llama3_8b", 8_030_261_248, 41_943_040),
    ],
)
def test_counts_are_the_published_ones(shape, total, trainable):
    dims = peft_bench.SHAPES[shape]
    embedding, norms = dims.vocab_size * dims.dim, (2 * dims.num_layers + 1) * dims.dim
    assert peft_bench.frozen_matmul_params(dims) == total - embedding - norms
    assert peft_bench.adapter_params(dims, rank=16) == trainable


def test_model_flops_follow_design_s_lora_count():
    dims = peft_bench.SHAPES["llama2_7b"]
    frozen, adapters = 6_738_415_616 - 32000 * 4096 - 65 * 4096, 39_976_960
    want = 4 * frozen + 6 * adapters + 6 * 32 * 4096 * 4096
    assert peft_bench.model_flops_per_token(dims, seq_len=4096, rank=16) == want


def test_an_unreadable_comparison_file_stops_before_the_run(tmp_path, capsys):
    bad = tmp_path / "ours.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        peft_bench.main(["--shape=tiny", f"--compare_with={bad}"])
    assert exit_info.value.code == 2
    assert "not an axlearn.bench --json_out result" in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_run_prints_bench_s_columns_beside_ours(tmp_path):
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps({"config": "x", "tokens_per_s_per_device": 1.0, "jax_version": "j"}))
    out = tmp_path / "peer.json"
    proc = subprocess.run(
        [
            sys.executable, "tools/peft_bench.py", "--shape=tiny", "--batch=2", "--seq_len=32",
            "--steps=2", "--warmup_steps=1", "--gradient_checkpointing",
            f"--compare_with={ours}", f"--json_out={out}",
        ],
        cwd=REPO, env=fresh_env(), capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    titles = [line.split("|")[0].strip() for line in proc.stdout.splitlines()]
    assert [title for title, *_ in peft_bench.COLUMNS] == titles[2 : 2 + len(peft_bench.COLUMNS)]
    assert re.search(r"^ours / peer tokens/s/device: [\d.]+x$", proc.stdout, re.MULTILINE)
    result = json.loads(out.read_text())
    # 2 layers of LoRA r=16 on q, k, v, o (64 -> 64, 64 -> 32 twice, 64 -> 64), gate and
    # up (64 -> 128) and down (128 -> 64): 16 x (in + out) each.
    assert result["num_trainable_params"] == 2 * 16 * (128 + 96 + 96 + 128 + 192 + 192 + 192)
    assert result["tokens_per_step"] == 64 and result["tokens_per_s_per_device"] > 0
    assert 0 < result["final_loss"] < 10
