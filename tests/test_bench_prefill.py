"""bench/rollout/prefill_profile.py on the CPU: the FLOP estimate on hand-built configs, the
kernel grouping and the kernel table on hand-built profiles, argument errors before any model
is built, and a --tiny run end to end."""

NUM_GPUS = 0

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "rollout" / "prefill_profile.py"
sys.path.insert(0, str(SCRIPT.parent))
import prefill_profile as prefill


def test_flops_per_token_from_its_definition():
    config = SimpleNamespace(
        hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=16, vocab_size=100,
    )  # fmt: skip
    # head_dim = 8 / 4 = 2. Weights a layer: q 8x8 = 64, k 8x4 = 32, v 32, o 64, gate 8x16 =
    # 128, up 128, down 128: 576. GEMMs: 2 FLOPs a weight, 2 layers.
    gemm = 2 * 576 * 2  # 2304
    # Prompts of T = 4 tokens: token i attends to i + 1 keys, mean (1 + 2 + 3 + 4) / 4 = 2.5.
    # Per key and layer, q.k and p.v over 4 heads x 2 dims: 2 x (2 x 4 x 2) = 32 FLOPs.
    attention = 32 * 2.5 * 2  # 160
    # One kept row of logits per prompt: 2 x 8 x 100 = 1600 FLOPs, over its 4 tokens.
    lm_head = 1600 / 4  # 400
    got = prefill.flops_per_token(config, prompt_tokens=4)
    assert got == pytest.approx(
        {"gemm": gemm, "attention": attention, "lm_head": lm_head, "total": 2864}
    )


def test_flops_per_token_reads_an_explicit_head_dim():
    # Qwen3-style: head_dim 4 is not hidden / heads (6 / 2 = 3). One layer, T = 1.
    config = SimpleNamespace(
        hidden_size=6, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=4, intermediate_size=10, vocab_size=50,
    )  # fmt: skip
    # q 6x8 = 48, o 48, k 6x4 = 24, v 24, gate/up/down 3 x 60 = 180: 324 weights.
    # Attention: 1 key, 2 x (2 x 2 heads x 4 dims) = 32. Head: 2 x 6 x 50 = 600 over 1 token.
    got = prefill.flops_per_token(config, prompt_tokens=1)
    assert got == pytest.approx({"gemm": 648, "attention": 32, "lm_head": 600, "total": 1280})


def test_flops_per_token_of_the_qwen25_05b_shape():
    # The shape the GPU run measures: 24 layers of 896 wide, 14 heads of 64, 2 KV heads, MLP
    # 4864. Weights a layer: 2 x 896 x 896 + 2 x 896 x 128 + 3 x 896 x 4864 = 14,909,440.
    config = SimpleNamespace(**prefill.SHAPES["0.5b"])
    got = prefill.flops_per_token(config, prompt_tokens=1024)
    assert got["gemm"] == 2 * 14_909_440 * 24
    assert got["attention"] == pytest.approx(4 * 14 * 64 * 1025 / 2 * 24)
    assert got["lm_head"] == pytest.approx(2 * 896 * 151936 / 1024)


# Kernel names as CUDA profiles of the eager and the compiled prefill name them.
KERNELS = {
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN": "gemm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, "
    "false, cutlass::bfloat16_t>, false, true>(pytorch_flash::Flash_fwd_params)": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0": "attention",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps"
    "<float, float, float, float>, unsigned int, float, 4, 4> >(...)": "norm: pow/mean/rsqrt",
    "void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda(at::"
    "TensorIteratorBase&)::{lambda()#2}, std::array<char*, 2ul> >(...)": "norm: pow/mean/rsqrt",
    "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::"
    "TensorIteratorBase&)::{lambda()#1}, std::array<char*, 2ul> >(...)": "silu",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...> >(...)": (
        "index/gather (KV write)"
    ),
    "void at::native::_scatter_gather_elementwise_kernel<128, 8, ...>(...)": (
        "index/gather (KV write)"
    ),
    "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16, "
    "c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, "
    "std::array<char*, 3ul> >(...)": "mul/add",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::"
    "BFloat16>, std::array<char*, 3ul> >(...)": "mul/add",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::"
    "TensorIteratorBase&)::{lambda()#3}, ...>(...)": "cast/copy/cat",
    # Inductor's fused kernels name what they fuse; they stay "fused", not the norm's pieces.
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "fused (inductor)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::cos_kernel_cuda(at::"
    "TensorIteratorBase&)::{lambda()#2}, std::array<char*, 2ul> >(...)": "elementwise",
}


class FakeProfile:
    """What _kernel_table and kernel_summary read of a torch.profiler profile."""

    def __init__(self, events):
        self.events = events

    def key_averages(self):
        return self.events


def test_prefill_kernels_fall_in_their_groups():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [
        SimpleNamespace(
            key=name, count=2, device_type=cuda, self_device_time_total=1000.0 * (i + 1)
        )
        for i, name in enumerate(KERNELS)
    ]
    events.append(
        SimpleNamespace(key="aten::mm", count=7, device_type=cpu, self_cpu_time_total=2500.0)
    )
    got = prefill.kernel_summary(FakeProfile(events))
    expected: dict[str, float] = {}
    for i, group in enumerate(KERNELS.values()):
        expected[group] = expected.get(group, 0.0) + (i + 1)  # ms: 1000 us a step
    assert got["kernel_ms_by_group"] == pytest.approx(expected)
    assert got["kernels"] == 2 * len(KERNELS)
    assert got["kernel_ms"] == pytest.approx(sum(range(1, len(KERNELS) + 1)))
    assert got["top_host_ops"] == [["aten::mm", 7, 2.5]]


def test_kernel_table_puts_a_chunk_of_the_engine_beside_each_forward():
    result = {
        "settings": {"chunks": 4},
        "engine": {
            "median_s": 0.010,
            "profile": {
                "kernels": 400, "kernel_ms": 8.0, "wall_ms_profiled": 12.0, "idle_ms": 2.0,
                "kernel_ms_by_group": {"gemm": 6.0, "attention": 2.0},
                "top_kernels": [["nvjet|x", 40, 6.0]],
            },
        },
        "forward": {
            "eager": {
                "profile": {
                    "kernels": 90, "kernel_ms": 1.5,
                    "kernel_ms_by_group": {"gemm": 1.4, "silu": 0.1},
                },
            },
            "flash": {"skipped": "CUDA only"},
        },
    }  # fmt: skip
    lines = prefill.kernel_lines(result)
    assert "| kind | engine (generate), a chunk | forward eager |" in lines
    # The engine's call over its 4 chunks: one forward's worth, as the forward column.
    assert "| gemm | 1.50 | 1.40 |" in lines
    assert "| attention | 0.50 | 0.00 |" in lines
    assert "| silu | 0.00 | 0.10 |" in lines
    assert "| all kernels | 2.00 | 1.50 |" in lines
    assert "| kernel count | 100 | 90 |" in lines
    text = "\n".join(lines)
    assert "the device waits 2.0 ms (20%) for the host" in text
    assert "| `nvjet/x` | 40 | 6.00 |" in text  # a | in a name would split the row


@pytest.mark.parametrize(
    ("argv", "cuda", "says"),
    [
        ([], False, "CUDA is not available: .* pass --tiny"),
        (["--shape", "9b"], True, "--shape='9b': use one of"),
        (["--tiny", "--repeats", "0"], False, "--repeats=0: must be >= 1"),
        (["--tiny", "--forward-repeats", "0"], False, "--forward-repeats=0: must be >= 1"),
        (["--tiny", "--max-seq-len", "32"], False, "must exceed --prompt-tokens=32"),
        (
            ["--tiny", "--max-prefill-tokens", "39"],
            False,
            "--max-prefill-tokens=39: must be >= --max-seq-len=40",
        ),
        (["--tiny", "--variants", "eager,fast"], False, "--variants=eager,fast: use some of"),
    ],
)
def test_bad_arguments_fail_before_any_model(monkeypatch, argv, cuda, says):
    def no_models(*args, **kwargs):
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(prefill, "prepare_model", no_models)
    monkeypatch.setattr(prefill.torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(prefill.UsageError, match=says):
        prefill.main(argv)


def test_the_command_line_says_why_without_a_traceback(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU, whatever this machine has
    out, models = tmp_path / "p.json", tmp_path / "models"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--model-root", str(models)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert "prefill_profile.py: error: CUDA is not available" in done.stderr
    assert "--tiny" in done.stderr and "Traceback" not in done.stderr
    assert not models.exists() and not out.exists()


def test_tiny_run_writes_every_number(tmp_path):
    out = tmp_path / "prefill.json"
    argv = ["--tiny", "--engine-compile-prefill", "--out", str(out)]
    prefill.main([*argv, "--model-root", str(tmp_path / "models")])
    result = json.loads(out.read_text())
    assert result["errors"] == {}
    assert result["device"] == "cpu" and result["nominal_bf16_flops"] is None
    assert result["commit"] and result["versions"]["torch"] == torch.__version__
    settings = result["settings"]
    # --tiny: 4 prompts of 32 tokens; 64 prefill tokens a forward: 2 chunks of 2 rows.
    assert (settings["batch"], settings["prompt_tokens"], settings["new_tokens"]) == (4, 32, 1)
    assert (settings["chunk_rows"], settings["chunks"]) == (2, 2)
    assert result["model"]["num_hidden_layers"] == 2

    per_token = result["flops_per_token"]
    assert per_token["total"] == pytest.approx(
        per_token["gemm"] + per_token["attention"] + per_token["lm_head"]
    )
    # The bound's FLOPs, counted from the model's own nn.Linear shapes, are the estimate's
    # GEMM and head FLOPs for the chunk's 2 x 32 tokens.
    bound = result["gemm_bound"]
    assert bound["flops"] == pytest.approx((per_token["gemm"] + per_token["lm_head"]) * 64)
    assert bound["tok_s"] == pytest.approx(64 / bound["median_s"]) and bound["tok_s"] > 0

    for key in ("engine", "engine_compile_prefill"):
        row = result[key]
        assert row["EngineConfig"]["max_batch_size"] == 4
        assert row["EngineConfig"]["max_prefill_tokens"] == 64
        assert row["EngineConfig"]["dtype"] == "bfloat16"
        assert len(row["seconds"]) == 3
        assert row["tok_s"] == pytest.approx(4 * 32 / statistics.median(row["seconds"]))
        assert row["tok_s"] > 0 and row["first_call_s"] > 0
        assert row["ms_per_chunk"] == pytest.approx(row["median_s"] * 1e3 / 2)
        profile = row["profile"]
        assert profile["wall_ms_profiled"] > 0 and profile["top_host_ops"]
        assert profile["kernels"] == 0  # no device kernels on the CPU
    assert result["engine"]["EngineConfig"]["compile_prefill"] is False
    assert result["engine_compile_prefill"]["EngineConfig"]["compile_prefill"] is True

    forward = result["forward"]
    for name in ("eager", "compiled"):
        assert len(forward[name]["seconds"]) == 5
        assert forward[name]["tok_s"] == pytest.approx(64 / forward[name]["median_s"])
        assert forward[name]["tok_s"] > 0 and forward[name]["profile"]["top_host_ops"]
    for name in ("flash", "cudnn"):
        assert forward[name] == {"skipped": "CUDA only: an SDPA backend of CUDA"}

    # The derived numbers, from their definitions.
    eager = forward["eager"]["tok_s"]
    for row in (result["engine"], result["engine_compile_prefill"], forward["compiled"]):
        assert row["tflop_s"] == pytest.approx(per_token["total"] * row["tok_s"] / 1e12)
        assert row["of_gemm_bound"] == pytest.approx(row["tok_s"] / bound["tok_s"])
        assert row["vs_eager_forward"] == pytest.approx(row["tok_s"] / eager)
        assert row["of_nominal_peak"] is None
    ratios = result["ratios"]
    assert ratios["compiled_over_eager_forward"] == pytest.approx(
        forward["compiled"]["tok_s"] / eager
    )
    assert ratios["engine_compile_prefill_over_engine"] == pytest.approx(
        result["engine_compile_prefill"]["tok_s"] / result["engine"]["tok_s"]
    )

    md = out.with_suffix(".md").read_text()
    for row in ("| engine (generate) |", "| engine, compile_prefill |", "| forward eager |"):
        assert row in md
    assert "| forward compiled |" in md and "| GEMMs only" in md
    assert "- forward flash: CUDA only" in md
