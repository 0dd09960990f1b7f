"""Run settings, the PASS/FAIL record and shared helpers of bench/rollout/rollout_gpu.py.

`RUN` is one settings object that --smoke changes in place; every module reads its attributes
at call time, so the change reaches them all. CHECKS and CHECK_DETAILS are only ever mutated.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from yatt.rollout import EngineConfig, Request, SamplingParams


@dataclass(kw_only=True)
class Settings:
    device: str = "cuda"
    smoke: bool = False  # --smoke: a tiny model on CPU, to test this script without a GPU
    prompt_len: int = 128
    new_tokens: int = 512
    # HF generate forces the same length as yatt: the benchmark's workload
    hf_tokens: dict[int, int] = field(default_factory=lambda: {64: 512, 256: 512})
    throughput_only: bool = False  # --throughput-only: skip the checks and HF generate
    # The judge-like prefill load: batch and new tokens; prompts of one fixed length, and mixed
    # lengths in [lo, hi] (the judge reads prompt + response, 300-1,300 tokens).
    prefill_batch: int = 256
    prefill_new_tokens: int = 128
    prefill_fixed_len: int = 1024
    prefill_mixed_lens: tuple[int, int] = (300, 1300)


RUN = Settings()
CHECKS: dict[str, bool] = {}
CHECK_DETAILS: dict[str, str] = {}


def qwen25_05b_config() -> Qwen2Config:
    # Qwen2.5-0.5B's shape; --smoke shrinks the layers and keeps the vocabulary.
    big = dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864
    )
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    rest = dict(vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6, eos_token_id=151643)
    return Qwen2Config(
        **(small if RUN.smoke else big), **rest, num_key_value_heads=2, bos_token_id=151643
    )


def build_model(seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device(RUN.device):
        model = AutoModelForCausalLM.from_config(
            qwen25_05b_config(), dtype=dtype, attn_implementation="sdpa"
        )
    return model.eval().requires_grad_(False)


def free_bytes(*, empty_cache: bool = False) -> int:
    gc.collect()
    if RUN.device == "cpu":
        return 0
    torch.cuda.synchronize()
    if empty_cache:
        torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def reserved_by_pool() -> dict:
    """What torch's allocator still reserves, per memory pool (tms regions are pools too)."""
    if RUN.device == "cpu":
        return {}
    pools: dict[str, dict] = {}
    for seg in torch.cuda.memory_snapshot():
        row = pools.setdefault(str(seg.get("segment_pool_id")), {"reserved": 0, "allocated": 0})
        row["reserved"] += seg["total_size"]
        row["allocated"] += seg["allocated_size"]
    return pools


def compare_greedy(a, b) -> dict:
    """Greedy runs a and b, sample by sample: where they first differ and how close they are.

    prefix_max_diff: largest logprob difference before the first differing token.
    tie_max_gap: at each first differing token, |logprob chosen in a - logprob chosen in b|;
        both were the argmax of their run, so near 0 means a tie, large means a real change.
    """
    first, diffs, gaps, compared, total = [], [0.0], [0.0], 0, 0
    for ca, cb in zip(a, b, strict=True):
        n = min(len(ca.response_ids), len(cb.response_ids))
        k = next((i for i in range(n) if ca.response_ids[i] != cb.response_ids[i]), n)
        first.append(k if k < n else None)
        diffs += [abs(x - y) for x, y in zip(ca.logprobs[:k], cb.logprobs[:k], strict=True)]
        if k < n:
            gaps.append(abs(ca.logprobs[k] - cb.logprobs[k]))
        compared, total = compared + k, total + n
    return {
        "num_identical": sum(k is None for k in first),
        "num": len(first),
        "first_divergence": first,
        "prefix_max_diff": max(diffs),
        "tie_max_gap": max(gaps),
        "compared_fraction": compared / max(total, 1),
    }


def agrees(cmp: dict, *, atol: float, min_fraction: float) -> bool:
    return (
        cmp["prefix_max_diff"] <= atol
        and cmp["tie_max_gap"] <= atol
        and cmp["compared_fraction"] >= min_fraction
    )


def describe(cmp: dict) -> str:
    return (
        f"{cmp['num_identical']}/{cmp['num']} identical, first divergences "
        f"{[k for k in cmp['first_divergence'] if k is not None]}, prefix logprob diff "
        f"{cmp['prefix_max_diff']:.1e}, tie gap {cmp['tie_max_gap']:.1e}"
    )


def sync() -> None:
    if RUN.device == "cuda":
        torch.cuda.synchronize()


def check(name: str, ok: bool, detail: str) -> None:
    CHECKS[name] = bool(ok)
    CHECK_DETAILS[name] = detail
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def prompts(num: int, length: int, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 150000, (num, length), generator=g)
    return [Request(prompt_ids=row.tolist()) for row in ids]


def greedy(n_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n_tokens, ignore_eos=True)


def engine_config(
    batch: int, dtype: str = "bfloat16", max_seq_len: int | None = None, **kwargs
) -> EngineConfig:
    seq_len = max_seq_len or RUN.prompt_len + RUN.new_tokens
    # keep_graphs_asleep=False: the memory check expects sleep to return every byte.
    kwargs.setdefault("keep_graphs_asleep", False)
    return EngineConfig(
        device=RUN.device, dtype=dtype, max_batch_size=batch, max_seq_len=seq_len, **kwargs
    )


def trainer_logprobs(model, completions) -> list[torch.Tensor]:
    out = []
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.response_ids], device=RUN.device)
        logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(c.prompt_ids) :, None])[:, 0]
        out.append(lp.cpu())
    return out


def engine_tensors(engine) -> dict[str, torch.Tensor]:
    model = engine.model
    return {
        name: t.detach().cpu().clone()
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    }
