"""One rank of the engine-TP checks (gloo, CPU), against the vLLM 0.26.0 / SGLang 0.5.17 fakes.

    python _engine_tp_worker.py --out DIR --scenario NAME   (under yatt.testing.run_ranks)

Each scenario runs the adapters as a trainer would on every rank and writes what this rank saw
to DIR/<scenario>.<rank>.pt; test_engine_tp.py compares the ranks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from yatt.rollout import Request, SamplingParams, SGLangConfig, SGLangEngine, VLLMConfig, VLLMEngine
from yatt.rollout.testing import sglang_modules, vllm_modules


def _summary(completions) -> list[tuple]:
    return [
        (c.request_index, c.sample_index, c.response_ids, c.logprobs, c.finish_reason)
        for c in completions
    ]


async def _collect(stream) -> list:
    return [c async for c in stream]


def _error(fn) -> str | None:
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _full_weights() -> list[tuple[str, torch.Tensor]]:
    # The same full tensors on every rank (what MegatronPolicy.named_weights gives).
    return [
        ("model.layers.0.mlp.up_proj.weight", torch.arange(24.0).reshape(6, 4)),
        ("model.norm.weight", torch.arange(3.0)),  # 3 rows do not split over 2: replicated
    ]


def vllm_scenario(tp_size: int) -> dict:
    rank = dist.get_rank()
    engine = VLLMEngine("/models/x", config=VLLMConfig(tensor_parallel_size=tp_size))
    llm = engine._llm
    out: dict = {"kwargs": dict(llm.kwargs), "group": engine.tp_group.ranks}
    requests = [Request(prompt_ids=[10, 1]), Request(prompt_ids=[20])]
    # Unseeded: each rank draws its own seed; the group must take the first rank's.
    sampling = SamplingParams(n=2, max_new_tokens=3, label_token_ids=(7, 3))
    out["generate"] = _summary(engine.generate(requests, sampling))
    out["streamed"] = sorted(
        _summary(asyncio.run(_collect(engine.stream(requests, SamplingParams(max_new_tokens=2)))))
    )
    out["seen_seeds"] = dict(llm.llm_engine.seen_seeds)
    # An abort asked on the LAST rank only, mid-run: every rank stops at the same step.
    original_step = llm.llm_engine.step
    steps = []

    def step():
        steps.append(1)
        if len(steps) == 3 and rank == dist.get_world_size() - 1:
            engine._abort_event.set()  # what abort() does while a call runs
        return original_step()

    llm.llm_engine.step = step
    long = SamplingParams(max_new_tokens=50, seed=5)
    out["aborted"] = _summary(engine.generate([Request(prompt_ids=[5])] * 2, long))
    llm.llm_engine.step = original_step
    # A rank given another batch: refused on every rank, before the engine runs.
    odd = [Request(prompt_ids=[30 + rank])]
    out["mismatch_error"] = _error(lambda: engine.generate(odd, SamplingParams(seed=1)))
    # Unseeded samples (seed_each_sample=False) draw from the engine's global generator.
    engine.update_weights(_full_weights(), bucket_bytes=1 << 20)
    out["worker_weights"] = dict(llm.worker_weights)
    # A bucket short on the first rank only: every rank raises.
    if rank == 0:
        llm.rpc_results = [[0]]
    out["short_error"] = _error(lambda: engine.update_weights(_full_weights()))
    # The last rank passes one tensor fewer: caught after the load, on every rank.
    fewer = _full_weights()[: 1 if rank == dist.get_world_size() - 1 else 2]
    out["names_error"] = _error(lambda: engine.update_weights(fewer))
    engine.close()
    fast = VLLMEngine(
        "/models/x",
        config=VLLMConfig(tensor_parallel_size=tp_size, seed_each_sample=False, seed=7),
    )
    fast.generate(requests, SamplingParams(n=2, max_new_tokens=2))
    out["global_draws"] = list(fast._llm.llm_engine.global_draws)
    return out


def sglang_scenario(tp_size: int) -> dict:
    rank = dist.get_rank()
    engine = SGLangEngine("/models/x", config=SGLangConfig(tp_size=tp_size))
    inner = engine._engine
    out: dict = {
        "has_engine": inner is not None,
        "kwargs": dict(inner.kwargs) if inner is not None else None,
        "group": engine.tp_group.ranks,
        "max_seq_len": engine.max_seq_len,
        "vocab_size": engine.vocab_size,
    }
    requests = [Request(prompt_ids=[9]), Request(prompt_ids=[1])]
    sampling = SamplingParams(n=2, max_new_tokens=3, label_token_ids=(7,))
    out["generate"] = _summary(engine.generate(requests, sampling))
    # Streamed in finishing order: the same order on every rank.
    out["streamed"] = _summary(
        asyncio.run(_collect(engine.stream(requests, SamplingParams(max_new_tokens=2))))
    )
    if inner is not None:
        out["seen_seeds"] = [p.get("sampling_seed") for p in inner.seen_params]
    # Each rank passes its own copy (marked with its rank here, to see whose copy each TP
    # worker reads; in a run they are equal).
    marked = [(name, tensor + 1000 * rank) for name, tensor in _full_weights()]
    engine.update_weights(marked, bucket_bytes=1 << 20)
    if inner is not None:
        out["worker_weights"] = [dict(w) for w in inner.worker_weights]
        inner.update_results = [(False, "shape mismatch")]
    out["update_error"] = _error(lambda: engine.update_weights(_full_weights()))
    # The last rank passes another shape: refused before SGLang loads anything, on every rank.
    other = [(n, t[:2] if rank == dist.get_world_size() - 1 else t) for n, t in _full_weights()]
    out["names_error"] = _error(lambda: engine.update_weights(other))
    started = time.monotonic()
    engine.sleep()
    engine.wake_up(tags=["weights"])
    out["control_s"] = time.monotonic() - started
    if inner is not None:
        out["calls"] = list(inner.calls)
        inner.generate_error = RuntimeError("scheduler died")
    out["generate_error"] = _error(
        lambda: engine.generate([Request(prompt_ids=[2])], SamplingParams(max_new_tokens=2))
    )
    engine.close()
    return out


SCENARIOS = {
    "vllm_tp2": lambda: vllm_scenario(2),
    "vllm_tp1": lambda: vllm_scenario(1),
    "sglang_tp2": lambda: sglang_scenario(2),
    "sglang_tp1": lambda: sglang_scenario(1),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", required=True, action="append")
    args = parser.parse_args()
    sys.modules.update(vllm_modules())
    sys.modules.update(sglang_modules())
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    dist.init_process_group("gloo")
    for name in args.scenario:
        result = SCENARIOS[name]()
        torch.save(result, Path(args.out) / f"{name}.{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
