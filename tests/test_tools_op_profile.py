"""tools/op_profile.py: kernels of a trace attributed to the HLO ops of an XLA dump, on
synthetic traces (no GPU needed)."""

import pytest

from axlearn.bench import KernelEvent
from tools import op_profile

_STACK = "jit(_train_step)/transpose(jvp(decoder))/transformer/layer{}/feed_forward/linear2"
_DUMP = "\n".join(
    [
        "HloModule jit__train_step",
        "ENTRY %main {",
        *(
            f"  %custom-call.{layer + 4} = (bf16[16384,2048]{{1,0}}, s8[1024]{{0}}) "
            f'custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", '
            f'metadata={{op_name="{_STACK.format(layer)}/dot_general"}}'
            for layer in (3, 4)
        ),
        '  %loop_add_fusion.2 = bf16[8,16]{1,0} fusion(%e), kind=kLoop, calls=%f, '
        'metadata={op_name="jit(_train_step)/jvp(decoder)/transformer/layer0/feed_forward/add"}',
        "}",
    ]
)


def _names(tmp_path):
    path = tmp_path / "module_0001.jit__train_step.sm_9.0a_gpu_after_optimizations.txt"
    path.write_text(_DUMP)
    return op_profile.hlo_op_names(str(tmp_path))


def test_dump_gives_each_instruction_its_name_stack_kind_and_result(tmp_path):
    names = _names(tmp_path)
    matmul = names["custom-call.7"]
    assert matmul.kind == "gemm"
    assert matmul.result == "(bf16[16384,2048], s8[1024])"  # Layouts dropped.
    assert matmul.op_name == _STACK.format(3) + "/dot_general"
    # A fusion's kernel is named with '_' for '.': both spellings find it.
    assert names["loop_add_fusion_2"] == names["loop_add_fusion.2"]
    assert names["loop_add_fusion.2"].kind == "fusion"


def test_library_kernels_are_attributed_to_their_op_only_outside_a_cuda_graph(tmp_path):
    names = _names(tmp_path)
    events = [
        # Graphs off: the trace names the custom-call that launched the cuBLAS kernel.
        KernelEvent(0, "nvjet_sm90_tst_256x128", 1.0, "custom-call.7"),
        KernelEvent(1, "nvjet_sm90_tst_256x128", 3.0, "custom-call.8"),
        # Graphs on: only the graph's thunk. The cuBLAS kernel is known by its library...
        KernelEvent(2, "nvjet_sm90_tst_128x160", 2.0, "command_buffer_1"),
        # ...and a fusion by its kernel's name.
        KernelEvent(3, "loop_add_fusion_2", 0.5, "command_buffer_1"),
    ]
    rows = {r["op"]: r for r in op_profile.op_rows(events, names, steps=2)}
    assert rows["custom-call.8"]["ms_per_step"] == 1.5
    assert (rows["custom-call.8"]["phase"], rows["custom-call.8"]["part"]) == (
        "backward", "layerN/feed_forward/linear2"
    )
    assert rows["custom-call.8"]["result"] == "(bf16[16384,2048], s8[1024])"
    assert (rows["nvjet_sm90_tst_128x160"]["kind"], rows["nvjet_sm90_tst_128x160"]["phase"]) == (
        "gemm", "unknown"
    )
    assert (rows["loop_add_fusion_2"]["kind"], rows["loop_add_fusion_2"]["phase"]) == (
        "fusion", "forward"
    )

    top = op_profile.top_ops(list(rows.values()))
    # The same matmul of layers 3 and 4 is one row; the unnamed library kernel stays apart.
    assert [(r["ms_per_step"], r["count"]) for r in top] == [(2.0, 2), (1.0, 1), (0.25, 1)]
    assert "layerN/feed_forward/linear2" in top[0]["op_name"]
    assert top[1]["op"] == "nvjet_sm90_tst_128x160"


def test_main_names_a_profile_dir_without_a_trace(tmp_path, capsys):
    with pytest.raises(SystemExit):
        op_profile.main([f"--profile_dir={tmp_path}", f"--xla_dump_dir={tmp_path}", "--steps=1"])
    assert f"--profile_dir={tmp_path}: no GPU kernels in a trace there" in capsys.readouterr().err
