"""Train-phase MFU of MegatronPolicy on a ~0.5B Qwen2-shaped model at sequence length 2048,
and the GPU memory it gives back while asleep (the rollout phase).

    PYTHONPATH=$(ls -d packages/*/src | tr '\n' ':') python3 bench/megatron/megatron_mfu.py --out-dir $OUT
    torchrun --nproc-per-node 2 bench/megatron/megatron_mfu.py --tp 2     # the same on two GPUs

The model is Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads / 2 KV heads, FFN 4864,
vocab 151936, tied embeddings) with random weights, saved once as an HF checkpoint. Each
attention implementation ("sdpa": torch's flash kernel; "megatron": Megatron's local unfused
softmax) runs --steps timed train steps after --warmup, every sample 2048 tokens.
FLOPs per token (forward) = 2 x matmul parameters (lm_head included) + 2 x 2 x layers x
(s / 2 causal average) x heads x head_dim; a train step is 3 x forward. MFU divides by the
dense bf16 peak (989 TFLOP/s for H100 SXM and H200). Writes megatron_mfu_<gpu>.json, with
"limits": what bounds the number (attention kernel, the fusions Megatron runs without
TransformerEngine/Apex, as read from the built model's TransformerConfig) and a forward-only
timing (logprobs), so the forward/backward split is visible.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}
# TransformerConfig flags of kernels that need TransformerEngine, Apex or Megatron's compiled
# extensions; all off here (the GPU machine has none), each replaced by plain PyTorch ops.
FUSION_FLAGS = (
    "masked_softmax_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
)
ATTENTION_KERNELS = {
    "sdpa": "torch scaled_dot_product_attention, causal (flash kernel in bf16): O(s) memory",
    "megatron": "Megatron's local DotProductAttention: [b, h, s, s] scores, unfused softmax",
}
LIMITS = (
    "No TransformerEngine: RMSNorm, RoPE and SwiGLU run as separate memory-bound PyTorch ops "
    "(see 'fusions'), no fused cross-entropy, no FP8; attention per 'attention_kernel'. "
    "Logprobs and the loss copy [b, s, V/tp] logits to float32 (vocab 151936): memory-bound "
    "work the FLOP count credits only as the lm_head matmul. At DP > 1 the gradient "
    "reduce-scatter is not overlapped with backward (overlap_grad_reduce=False)."
)
SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def _save_model(path: Path) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**SHAPE, rope_theta=1e6, rms_norm_eps=1e-6)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)


def _flops_per_token(seq_len: int) -> float:
    h, f, v, layers = (
        SHAPE["hidden_size"],
        SHAPE["intermediate_size"],
        SHAPE["vocab_size"],
        SHAPE["num_hidden_layers"],
    )
    d = h // SHAPE["num_attention_heads"]
    kv = SHAPE["num_key_value_heads"] * d
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f  # qkv, o, gate/up/down
    matmul_params = layers * per_layer + v * h  # lm_head (tied, still a matmul)
    attention = 2 * 2 * layers * (seq_len / 2) * h
    return 3 * (2 * matmul_params + attention)


def _batch(num_samples: int, seq_len: int, vocab: int, seed: int):
    from yatt.core import Batch

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_samples):
        mask = torch.zeros(seq_len, dtype=torch.int64)
        mask[seq_len // 4 :] = 1
        rows.append(
            {
                "input_ids": torch.randint(0, vocab, (seq_len,), generator=gen),
                "loss_mask": mask,
                "advantages": 1.0,
            }
        )
    return Batch.from_samples(rows, token_keys=("input_ids", "loss_mask"))


def run(attention: str, model_dir: str, rt, args) -> dict:
    from yatt.core import PolicyLoss
    from yatt.core.megatron import MegatronPolicy, MegatronPolicyConfig

    config = MegatronPolicyConfig(
        model_dir=model_dir,
        tp_size=rt.tp_size,
        attention=attention,
        lr=1e-6,
        max_tokens_per_microbatch=args.micro_batch_tokens,
        sequence_parallel=rt.tp_size > 1,
    )
    policy = MegatronPolicy(config, rt)
    batch = _batch(args.samples, args.seq_len, SHAPE["vocab_size"], seed=rt.dp_rank)
    batch.tokens["old_logprobs"] = policy.logprobs(batch)  # also warms the forward
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    policy.logprobs(batch)
    torch.cuda.synchronize()
    logprobs_s = time.perf_counter() - t0
    loss_fn = PolicyLoss()
    for _ in range(args.warmup):
        policy.train_step(batch, loss_fn)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        metrics = policy.train_step(batch, loss_fn)  # ends in a host sync (grad norm, loss)
    elapsed = (time.perf_counter() - start) / args.steps
    tokens = args.samples * args.seq_len * rt.dp_size
    tflops_per_gpu = _flops_per_token(args.seq_len) * tokens / elapsed / 1e12 / rt.world_size
    name = torch.cuda.get_device_name()
    peak = next((p for k, p in PEAK_TFLOPS.items() if k in name), None)
    peak_train_bytes = torch.cuda.max_memory_allocated()
    free_awake = torch.cuda.mem_get_info()[0]
    allocated_awake = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    policy.sleep()
    sleep_s = time.perf_counter() - t0
    free_asleep, total = torch.cuda.mem_get_info()
    allocated_asleep = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    policy.wake_up()
    wake_s = time.perf_counter() - t0
    result = {
        "attention": attention,
        "attention_kernel": ATTENTION_KERNELS[attention],
        "fusions": {flag: bool(getattr(policy.gpt.config, flag, False)) for flag in FUSION_FLAGS},
        "step_s": elapsed,
        "logprobs_s": logprobs_s,  # forward only (no grad): a train step is ~3x in FLOPs
        "tokens_per_step": tokens,
        "tokens_per_s_per_gpu": tokens / elapsed / rt.world_size,
        "tflops_per_gpu": tflops_per_gpu,
        "mfu": tflops_per_gpu / peak if peak else None,
        "loss": metrics["loss"],
        "num_micro_batches": metrics["num_micro_batches"],
        "peak_train_allocated_gib": peak_train_bytes / 2**30,
        "allocated_awake_gib": allocated_awake / 2**30,
        "allocated_asleep_gib": allocated_asleep / 2**30,
        "device_free_awake_gib": free_awake / 2**30,
        "device_free_asleep_gib": free_asleep / 2**30,
        "device_total_gib": total / 2**30,
        "sleep_s": sleep_s,
        "wake_s": wake_s,
    }
    del policy
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=16, help="samples per DP rank per step")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--attention", nargs="+", default=["sdpa", "megatron"])
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from yatt.core import init_runtime

    with init_runtime(tp_size=args.tp) as rt:
        holder = [tempfile.mkdtemp(prefix="yatt-mfu-") if rt.rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        if rt.rank == 0:
            _save_model(Path(holder[0]))
        dist.barrier()
        results = [run(a, holder[0], rt, args) for a in args.attention]
        if rt.is_rank_zero:
            summary = {
                "device": torch.cuda.get_device_name(),
                "world_size": rt.world_size,
                "tp": rt.tp_size,
                "seq_len": args.seq_len,
                "shape": SHAPE,
                "limits": LIMITS,
                "runs": results,
            }
            for r in results:
                print(
                    f"{r['attention']:>8}: {r['step_s']:.3f} s/step, {r['tflops_per_gpu']:.1f} TFLOP/s/GPU, "
                    f"MFU {r['mfu']}, train peak {r['peak_train_allocated_gib']:.1f} GiB, asleep "
                    f"{r['allocated_asleep_gib']:.2f} GiB allocated (free {r['device_free_asleep_gib']:.1f}"
                    f"/{r['device_total_gib']:.1f} GiB)"
                )
            gpu = summary["device"].replace(" ", "_").lower()
            out = Path(args.out_dir) / f"megatron_mfu_{gpu}_tp{rt.tp_size}_w{rt.world_size}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(summary, indent=1))
            print("wrote", out)


if __name__ == "__main__":
    main()
