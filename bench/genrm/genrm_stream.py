"""GenRM streaming vs scoring after the rollout, on a long-tailed response-length mix.

    python bench/genrm/genrm_stream.py                                   # CPU: fake + tiny real judge
    python bench/genrm/genrm_stream.py --judge tiny --device cuda --dtype bfloat16 \
        --tiny-hidden-size 1024 --tiny-num-layers 16 --num-samples 1024 --batch-size 64 \
        --rollout-seconds 20 --max-response-tokens 1024 --max-new-tokens 32 \
        --out bench/results/genrm_stream_gpu.json          # or --judge model --judge-model DIR

A fake rollout finishes sample i at t_i = rollout_seconds * len_i / max(len) (all samples decode
together, so a sample's finish time is proportional to its length; lengths are lognormal, so a
few stragglers set the rollout's end). Two ways to judge the same samples:
  after:  wait for the whole rollout, then score every sample (GenRM.ascore);
  stream: submit each sample to GenRM as it finishes, verdicts come out as they are ready.
Measured per mode: tail_s = last verdict - last rollout completion (what the trainer waits for
after generation), and overlap_share = judge busy time before the rollout's end / all judge busy
time. Judges: "fake" (FakeJudgeEngine, latency per batch = base + per-request cost), "tiny" (a
random tiny Qwen2 on the built-in engine, CPU) or "model" (--judge-model DIR, built-in engine).
Timings are compared within one run: each mode runs --repeats times and the median is kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from yatt.genrm import BatchingConfig, GenRM, Sample, YesNoParser, verification_template
from yatt.genrm.testing import FakeJudgeEngine
from yatt.rollout import SamplingParams


class TimedEngine:
    """Wraps a RolloutEngine and records each stream/generate call's busy interval."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = getattr(engine, "config", None)
        self.intervals: list[tuple[float, float]] = []

    def generate(self, requests: Sequence[Any], sampling: SamplingParams) -> list[Any]:
        start = time.perf_counter()
        try:
            return self.engine.generate(requests, sampling)
        finally:
            self.intervals.append((start, time.perf_counter()))

    async def stream(self, requests: Sequence[Any], sampling: SamplingParams) -> AsyncIterator[Any]:
        start = time.perf_counter()
        try:
            async for completion in self.engine.stream(requests, sampling):
                yield completion
        finally:
            self.intervals.append((start, time.perf_counter()))

    def close(self) -> None:
        self.engine.close()


def busy_time(intervals: list[tuple[float, float]], until: float = float("inf")) -> float:
    """Length of the union of `intervals`, clipped at `until`."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, until)
        if b > a:
            total += b - a
        end = max(end, min(b, until))
    return total


def make_schedule(num_samples: int, rollout_s: float, seed: int) -> tuple[list[int], list[float]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=np.log(300), sigma=0.9, size=num_samples), 16, 16384)
    lengths = lengths.astype(int)
    finish_s = rollout_s * lengths / lengths.max()
    return lengths.tolist(), finish_s.tolist()


def make_samples(lengths: list[int], seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    words = ["step", "so", "the", "answer", "is", "x", "=", "carry", "then", "we"]
    return [
        Sample(
            prompt=f"Compute {i} * 7.",
            # ~1 token per word: the judge template cuts long ones to max_response_tokens.
            response=" ".join(rng.choice(words, size=min(n, 2048))) + f" \\boxed{{{i * 7}}}",
            reference=str(i * 7),
            id=f"s{i}",
        )
        for i, n in enumerate(lengths)
    ]


async def run_mode(
    mode: str, genrm: GenRM, timed: TimedEngine, samples: list[Sample], finish_s: list[float]
) -> dict[str, float]:
    timed.intervals.clear()
    order = sorted(range(len(samples)), key=lambda i: finish_s[i])
    t0 = time.perf_counter()
    last_rollout = t0 + max(finish_s)
    last_verdict = t0
    num_verdicts = 0

    async def rollout(on_finish) -> None:
        for i in order:
            delay = t0 + finish_s[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await on_finish(samples[i])

    if mode == "after":
        done: list[Sample] = []

        async def collect(sample: Sample) -> None:
            done.append(sample)

        await rollout(collect)
        verdicts = await genrm.ascore(done)
        last_verdict, num_verdicts = time.perf_counter(), len(verdicts)
    else:

        async def producer() -> None:
            await rollout(genrm.submit)
            await genrm.finish()

        task = asyncio.create_task(producer())
        async for _ in genrm.results():
            num_verdicts += 1
            last_verdict = time.perf_counter()
        await task
    assert num_verdicts == len(samples), (num_verdicts, len(samples))
    total_busy = busy_time(timed.intervals)
    return {
        "tail_s": last_verdict - last_rollout,
        "total_s": last_verdict - t0,
        "rollout_s": last_rollout - t0,
        "judge_busy_s": total_busy,
        "overlap_share": busy_time(timed.intervals, until=last_rollout) / max(total_busy, 1e-9),
        "num_judge_calls": len(timed.intervals),
    }


def make_judge(args: argparse.Namespace, tmp: Path) -> Any:
    if args.judge == "fake":
        return FakeJudgeEngine(
            judge=lambda prompt, k: "Yes",
            batch_latency_s=args.fake_batch_latency_s,
            per_request_latency_s=args.fake_request_latency_s,
        )
    from yatt.rollout import BuiltinEngine, EngineConfig

    model_dir = args.judge_model
    if args.judge == "tiny":
        from yatt.testing import make_tiny_causal_lm

        model_dir = tmp / "tiny-judge"
        # Random weights: the judge's cost is real, its verdicts are noise (all unparsable).
        make_tiny_causal_lm(
            model_dir,
            arch="qwen2",
            hidden_size=args.tiny_hidden_size,
            num_layers=args.tiny_num_layers,
            num_heads=max(4, args.tiny_hidden_size // 64),
            num_kv_heads=max(2, args.tiny_hidden_size // 256),
            intermediate_size=4 * args.tiny_hidden_size,
            max_position_embeddings=args.max_seq_len,
        )
    if model_dir is None:
        raise SystemExit("--judge model needs --judge-model DIR")
    config = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.batch_size,
        max_seq_len=args.max_seq_len,
        region_prefix="genrm",
    )
    return BuiltinEngine(model_dir, config=config)


def bench_judge(args: argparse.Namespace, judge: str) -> dict[str, Any]:
    args = argparse.Namespace(**{**vars(args), "judge": judge})
    lengths, finish_s = make_schedule(args.num_samples, args.rollout_seconds, args.seed)
    samples = make_samples(lengths, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        timed = TimedEngine(make_judge(args, Path(tmp)))
        genrm = GenRM(
            timed,
            template=verification_template(max_response_tokens=args.max_response_tokens),
            parser=YesNoParser(),
            sampling=SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens),
            batching=BatchingConfig(
                max_batch_size=args.batch_size,
                batch_window_millis=args.window_millis,
                max_pending=max(args.num_samples, 1),
                # The built-in engine runs one generation at a time; a vLLM judge may take more.
                max_inflight_batches=args.max_inflight,
            ),
        )
        # Warm-up (model load, first-call compile) outside the measurement.
        genrm.score(samples[: args.batch_size])
        runs: dict[str, list[dict[str, float]]] = {"after": [], "stream": []}

        async def main() -> None:
            for _ in range(args.repeats):
                for mode in ("after", "stream"):
                    runs[mode].append(await run_mode(mode, genrm, timed, samples, finish_s))
            await genrm.aclose()

        asyncio.run(main())
        timed.close()
    result: dict[str, Any] = {
        "lengths": {
            "median": int(np.median(lengths)),
            "p90": int(np.percentile(lengths, 90)),
            "max": int(max(lengths)),
        }
    }
    for mode, rows in runs.items():
        result[mode] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        result[mode]["runs"] = rows
    result["tail_speedup"] = result["after"]["tail_s"] / max(result["stream"]["tail_s"], 1e-9)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--judge", choices=("fake", "tiny", "model", "cpu-all"), default="cpu-all")
    p.add_argument("--judge-model", type=Path, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tiny-hidden-size", type=int, default=64, help="--judge tiny model width")
    p.add_argument("--tiny-num-layers", type=int, default=2, help="--judge tiny model depth")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-samples", type=int, default=256)
    p.add_argument("--rollout-seconds", type=float, default=4.0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--window-millis", type=float, default=20.0)
    p.add_argument("--max-inflight", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--max-response-tokens", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--fake-batch-latency-s", type=float, default=0.05)
    p.add_argument("--fake-request-latency-s", type=float, default=0.004)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/genrm_stream_cpu.json"))
    args = p.parse_args()
    # A random tiny judge writes no verdicts; its unparsable-verdict warnings are noise here.
    logging.getLogger("yatt.genrm").setLevel(logging.ERROR)
    judges = ["fake", "tiny"] if args.judge == "cpu-all" else [args.judge]
    results = {judge: bench_judge(args, judge) for judge in judges}
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report = {"settings": settings, "machine": platform.platform(), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"\n{args.num_samples} samples, rollout {args.rollout_seconds:.1f} s, lengths "
        f"median/p90/max per judge below; median of {args.repeats} runs\n"
    )
    print("| judge | lengths med/p90/max | mode | tail after rollout (s) | total (s) "
          "| judge busy (s) | overlap share | judge calls |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for judge, r in results.items():
        lengths = "{median}/{p90}/{max}".format(**r["lengths"])
        for mode in ("after", "stream"):
            m = r[mode]
            print(
                f"| {judge} | {lengths} | {mode} | {m['tail_s']:.3f} | {m['total_s']:.3f} "
                f"| {m['judge_busy_s']:.3f} | {m['overlap_share']:.2f} | {m['num_judge_calls']:.0f} |"
            )
        print(f"| {judge} | | tail speedup | {r['tail_speedup']:.1f}x | | | | |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
