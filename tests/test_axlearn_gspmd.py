"""AXLearn's GSPMD 16B trainer configs (`gspmd-16B-2x16x8` and its `-stream` variant:
a 2-stage pipelined decoder, Adafactor with bfloat16 training) read from AXLearn's own
golden text: the text parses with every name and field resolved, dumps back unchanged, and
trains a step on the CPU at a reduced size. AXLearn's file is not kept in this repository
(shared/axlearn_goldens/ does not hold it): the tests read it from the directory that
AXLEARN_C4_TRAINER_GOLDENS names (a checkout's
`axlearn/experiments/testdata/axlearn.experiments.text.gpt.c4_trainer/`) and skip without it.
"""

import hashlib
import math
import os
import pathlib

import pytest

from axlearn.common.golden_text import parse_flat_text, unresolved_values

GOLDENS_ENV = "AXLEARN_C4_TRAINER_GOLDENS"
GPIPE_LINE = (
    "model.decoder.transformer.pipeline.schedule.klass: 'axlearn.common.pipeline.GPipeSchedule'"
)
# sha256 of AXLearn's two files (apple/axlearn, commit 34aed43c).
AXLEARN_SHA256 = {
    "gspmd-16B-2x16x8": "50ea25477f3525586b1cda143eaac0ad67990d5f7910e45fa58dce5c13a2de59",
    "gspmd-16B-2x16x8-stream": "9f1940c162a58e5f488de2704b926d8cabfeaac0f70a56d1695000a049400f5c",
}
SCHEDULES = {"gspmd-16B-2x16x8": "GPipeSchedule", "gspmd-16B-2x16x8-stream": "StreamSchedule"}
NAMES = sorted(AXLEARN_SHA256)


def _axlearn_text(name: str) -> str:
    """AXLearn's golden text of `name`: the kept file, or (-stream) that file with the
    pipeline schedule AXLearn's variant names; each checked against AXLearn's hash."""
    directory = os.environ.get(GOLDENS_ENV)
    if not directory or not (pathlib.Path(directory) / "gspmd-16B-2x16x8.txt").exists():
        pytest.skip(f"{GOLDENS_ENV} names no directory with AXLearn's gspmd-16B-2x16x8.txt")
    text = (pathlib.Path(directory) / "gspmd-16B-2x16x8.txt").read_text(encoding="utf-8")
    if name.endswith("-stream"):
        assert text.count(GPIPE_LINE) == 1
        text = text.replace(GPIPE_LINE, GPIPE_LINE.replace("GPipeSchedule", "StreamSchedule"))
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == AXLEARN_SHA256[name]
    return text


@pytest.mark.parametrize("name", NAMES)
def test_axlearn_gspmd_golden_parses_fully_resolved_and_dumps_back(name):
    text = _axlearn_text(name)
    cfg = parse_flat_text(text, source=name, foreign=True)
    assert unresolved_values(cfg) == []
    assert cfg.debug_string() + "\n" == text
    assert cfg.model.decoder.transformer.pipeline.schedule.klass.__name__ == SCHEDULES[name]


def _reduced(text: str, name: str):
    """AXLearn's GSPMD trainer from its golden text, at a CPU size: 2 layers (one a
    pipeline stage, 2 microbatches) of width 64, a 256-token vocabulary, 2 sequences of 32
    a step of synthetic tokens, one device."""
    from axlearn.common import launch_data  # pylint: disable=import-outside-toplevel

    cfg = parse_flat_text(text, source=name, foreign=True)
    cfg.mesh_shape = (1, -1, 1, 1, 1, 1)
    decoder = cfg.model.decoder
    decoder.set(vocab_size=256, dim=64)
    decoder.transformer.set(num_layers=2, num_microbatches=2)
    attention = decoder.transformer.layer.self_attention.attention
    attention.num_heads = 4
    attention.input_linear.input_linear.num_kv_heads = 2
    cfg.input.input_dispatcher.global_logical_batch_size = 2
    cfg.input.source.max_sequence_length = 32
    cfg.evalers = {}
    return launch_data.use_fake_data(cfg)


@pytest.mark.slow  # Compiles and runs a pipelined trainer (about 20 s on 2 CPU cores).
@pytest.mark.parametrize("name", NAMES)
def test_axlearn_gspmd_golden_trains_a_step_at_a_reduced_size(name):
    cfg = _reduced(_axlearn_text(name), name).set(max_step=1)
    trainer = cfg.instantiate(parent=None)
    pipeline = trainer.model.decoder.transformer
    assert pipeline.config.num_stages == 2
    schedule = pipeline.pipeline._schedule  # pylint: disable=protected-access
    assert type(schedule).__name__ == SCHEDULES[name]
    summaries = trainer.run()
    # At initialization the loss is about ln(256) = 5.55.
    assert trainer.step == 1 and math.isfinite(summaries["loss"])
    assert abs(summaries["loss"] - math.log(256)) < 0.5
