"""Do two built-in engine loops in one process slow each other down through the GIL?

    python bench/rollout/engine_host_cost.py [--device-ms 4] [--steps 256] [--out FILE.json]

Partial colocation runs the policy engine and the judge engine in one process, each looping in
its own thread. Here each engine's decode step is replaced by a GIL-releasing sleep of
--device-ms (a GPU step as the host sees it: a graph replay, then waiting) plus the slot
bookkeeping a step does; what is left is the host loop itself (scheduling, harvests every
steps_per_sync steps, completions). One engine
alone, then two at once: if the loops fought over the GIL, the pair would take longer than one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device-ms", type=float, default=4.0, help="emulated decode step")
    parser.add_argument("--steps", type=int, default=256, help="new tokens per sample")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams
    from yatt.testing import make_tiny_causal_lm

    model_dir = Path(tempfile.mkdtemp()) / "tiny"
    make_tiny_causal_lm(model_dir, arch="qwen2", max_position_embeddings=2048)

    def engine(prefix: str) -> BuiltinEngine:
        config = EngineConfig(
            max_batch_size=args.slots, max_seq_len=args.steps + 16, region_prefix=prefix
        )
        built = BuiltinEngine(model_dir, config=config)
        runner = built._runner

        def device_step(flags, span) -> None:
            # The slots advance as a real step would (a few small ops); no model runs.
            runner.gen_len_S += runner.active_S.long()
            runner.active_S &= runner.gen_len_S < runner.limit_S
            time.sleep(args.device_ms / 1e3)  # the GPU's time, GIL released

        runner.run_decode_step = device_step
        return built

    engines = [engine("a"), engine("b")]
    sampling = SamplingParams(max_new_tokens=args.steps, ignore_eos=True, seed=1)
    requests = [Request(prompt_ids=[5, 6, 7 + i]) for i in range(args.slots)]

    def run(chosen: list[BuiltinEngine]) -> float:
        threads = [threading.Thread(target=e.generate, args=(requests, sampling)) for e in chosen]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start

    run(engines[:1])  # warm-up
    alone = [run(engines[:1]) for _ in range(args.repeats)]
    pair = [run(engines) for _ in range(args.repeats)]
    device_s = args.steps * args.device_ms / 1e3
    result = {
        "args": vars(args),
        "device_s": device_s,
        "alone_s": alone,
        "pair_s": pair,
        "host_ms_per_step_alone": (statistics.median(alone) - device_s) / args.steps * 1e3,
        "pair_over_alone": statistics.median(pair) / statistics.median(alone),
    }
    print(
        f"{args.steps} steps of {args.device_ms} ms (device {device_s:.2f} s): one engine "
        f"{statistics.median(alone):.3f} s, two at once {statistics.median(pair):.3f} s "
        f"(x{result['pair_over_alone']:.3f}); host {result['host_ms_per_step_alone']:.3f} ms/step"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    for e in engines:
        e.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
