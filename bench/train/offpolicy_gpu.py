"""Issue 48's one-GPU run: the reference trainer at rollout.max_staleness = 0, 1 and 2, side by
side, each its own process on the same models and data.

    python3 bench/train/offpolicy_gpu.py --out-dir OUT            # 0.5B policy, 1.5B judge, GPU
    python3 bench/train/offpolicy_gpu.py --steps 100 --out-dir OUT
    python bench/train/offpolicy_gpu.py --smoke --out-dir /tmp/x  # the embedded task on CPU
    python3 bench/train/offpolicy_gpu.py --staleness 1 --out-dir OUT  # one s; OUT's others kept

Each run is `examples/train_grpo.py placement=partial rollout.max_staleness=s` (s = 0: today's
on-policy step). GPU: a Qwen2.5-0.5B-shape policy and a 1.5B-shape judge with random weights
(bench/step/_step_setup.make_models, byte tokenizer), addition prompts of two digits,
responses up to --max-new-tokens (the cap). Random weights almost never emit EOS, so the
policy's weights are shaped (_longtail_policy.py, --length-mix longtail, the default) to give
the trainer's own rollout a long-tail length mix: 90% of responses end by EOS with a geometric
length of median cap / 8, 10% run to the cap; at cap 512 the lengths' median is 75, p80 202,
p90 and max 512, 10.3% at the cap. The same distribution for every s (the same seeded weights
and shaping; the draws differ once the runs' weights do). --length-mix cap keeps the unshaped
weights (every response at the cap). The judge's weights are shaped too (_verdict_judge.py): it
reasons for a geometric number of tokens (median --judge-reasoning-median), then writes "Yes"
or "No" on its last line, a coin, two votes per response. The reward is that noise, so the
reward curve checks the plumbing, not learning (--smoke's embedded task learns). --tiny: the
same setup at 2-layer shapes, a CPU check.

Reported per s: step time (median over the steps after --warmup, the sum of the trainer's
time/* phases: what the step waited for), the trainer's wait for rollout (off-policy), GPU busy
fraction (nvidia-smi's utilization sampled every 200 ms, averaged after the warm-up steps;
none on CPU; the samples in s<n>/gpu_busy.json),
the staleness histogram (loss tokens by age, summed over steps), the IS weight's mean by age,
the reward curve (reward/mean per step), and the response lengths the trainer logged
(response/length_p50, _p90, _max, truncated_frac: over the run, at the first and at the last
step, beside the mix asked for), loss tokens trained per second of step (lengths can move
during a run; --lr holds them). Ratios: step time of s = 1 and 2 over s = 0, and time per loss
token (s = 0's tokens/s over s's); the
one-GPU bound two engines at once allow is bench/results/engines_overlap_nvidia_h200.md's 0.84.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "_common"))
sys.path.insert(0, str(ROOT / "bench" / "step"))
import _longtail_policy as longtail  # noqa: E402  (bench/train: beside this file)
import _verdict_judge as verdict_judge  # noqa: E402
from report import write_report  # noqa: E402

TRAINER = ROOT / "examples" / "train_grpo.py"
STALENESS = (0, 1, 2)
NUM_PROMPT_ROWS = 2048  # the GPU runs' data (more than 100 steps x 16 prompts)
ONE_GPU_OVERLAP = 0.84  # two engines at once / one after the other (engines_overlap_nvidia_h200)


class BusySampler:
    """GPU utilization (nvidia-smi, percent) sampled in a thread, each sample with the number of
    steps the trainer had logged by then (lines of its metrics.jsonl); `fraction` is the mean
    over the samples after the warm-up steps, None without samples. The samples are rewritten
    to `path` as they come: a machine taken back before the bench writes its report (the H200
    run at 2386771 lost s = 0's fraction so) still leaves them in the pack."""

    def __init__(self, path: Path, *, metrics: Path, warmup: int, period_s: float = 0.2) -> None:
        self.samples: list[tuple[float, int]] = []  # (busy fraction, steps logged)
        self._path, self._metrics, self._warmup = path, metrics, warmup
        self._stop = threading.Event()
        self._period_s = period_s
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _steps_logged(self) -> int:
        try:
            return self._metrics.read_bytes().count(b"\n")
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            steps = self._steps_logged()  # before the reading: a reading is never older
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout.split()
            except (OSError, subprocess.TimeoutExpired):
                return  # no GPU tool: no fraction
            if out:
                self.samples.append((float(out[0]) / 100, steps))
                if len(self.samples) % 25 == 0:
                    self._save()

    def _save(self) -> None:
        self._path.write_text(json.dumps({"warmup": self._warmup, "samples": self.samples}))

    def __enter__(self) -> BusySampler:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.samples:
            self._save()

    @property
    def fraction(self) -> float | None:
        return busy_fraction(self.samples, warmup=self._warmup)


def busy_fraction(samples: list[tuple[float, int]], *, warmup: int) -> float | None:
    """Mean busy fraction over the samples taken once `warmup` steps were logged (the loading
    and the first step's compiles left out); over all samples when none came after; None
    without samples."""
    timed = [busy for busy, steps in samples if steps >= warmup]
    chosen = timed or [busy for busy, _ in samples]
    return statistics.mean(chosen) if chosen else None


def prepare(args: argparse.Namespace) -> list[str]:
    """The runs' model and data overrides: the embedded task (--smoke) or random 0.5B/1.5B."""
    work = Path(args.out_dir) / "work"
    if args.smoke:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        subprocess.run(
            [sys.executable, str(TRAINER), f"out_dir={work / 'build'}", "num_steps=0"],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )  # builds the embedded task (its fitted models and prompts), in out_dir/embedded
        embedded = work / "build" / "embedded"
        return [
            "task=text",
            f"policy.model_dir={embedded / 'policy'}",
            f"data.path={embedded / 'prompts.jsonl'}",
            f"reward.judge_dir={embedded / 'judge'}",
        ]
    # Addition prompts like the embedded task's (random-weight models: any prompts do), written
    # here: building the embedded task fits its tiny models on the CPU first, a minute of
    # device time for nothing, and bench/ imports nothing of the trainer but its step module.
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    rng = random.Random(0)
    pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(NUM_PROMPT_ROWS)]
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in pairs)
    )
    task = {"prompts": prompts}
    import _step_setup as setup

    policy_dir, judge_dir = setup.make_models(
        work / "models", tiny=args.tiny, shapes=("0.5b", "1.5b")
    )
    # The random judge shaped to write "<reasoning>\nYes" or "...No" (_verdict_judge.py): a
    # random judge's verdicts all fail, and the trainer stops at step 0 (the run at 8d2b377).
    chain = verdict_judge.VerdictChain(reasoning_median=args.judge_reasoning_median)
    judge_dir = verdict_judge.shape_judge(
        judge_dir, work / "models" / "judge_verdicts", chain=chain
    )
    if args.length_mix == "longtail":  # EOS shaped into the weights: the trainer samples the mix
        mix = longtail.LengthMix(cap=args.max_new_tokens)
        shaping = longtail.Shaping.for_mix(mix, vocab_size=setup.QWEN25_05B["vocab_size"])
        policy_dir = longtail.shape_policy(policy_dir, work / "models" / "policy_longtail",
                                           shaping=shaping)  # fmt: skip
    return [
        f"policy.model_dir={policy_dir}",
        f"data.path={task['prompts']}",
        "data.answer_key=answer",
        f"reward.judge_dir={judge_dir}",
        # Two votes: genrm samples votes at temperature 1 (one vote is greedy: every verdict
        # the same coin side, no group with reward variance); read from the text (the label's
        # probability is the chain's 1/2 for every response).
        "reward.votes=2",
        "reward.verdict_from=text",
        f"reward.verdict_max_tokens={chain.reasoning_quantile(0.999) + 8}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"policy.lr={args.lr}",
        f"rollout.engine.max_seq_len={args.max_new_tokens + 64}",
    ]


def run_one(staleness: int, base: list[str], args: argparse.Namespace) -> dict:
    out = Path(args.out_dir) / f"s{staleness}"
    shutil.rmtree(out, ignore_errors=True)
    command = [
        sys.executable,
        str(TRAINER),
        f"out_dir={out}",
        *base,
        f"placement={args.placement}",
        f"rollout.max_staleness={staleness}",
        f"num_steps={args.steps}",
        f"data.prompts_per_rank={args.prompts}",
        "eval.every_steps=0",
        "export.dir=''",
        # One checkpoint on disk at a time: the saves still run as in a user's run, but three
        # runs keeping three 0.5B checkpoints each (weights and Adam state) filled the H200
        # machine's 64 GiB disk in s = 2's run at 3991ef1 (torch.save: "unexpected pos").
        "ckpt.keep_last=1",
        *args.extra,
    ]
    # The whole log, written as the run goes: a failed run's cause can sit above its last lines
    # (the H200 run at 16ea75f kept only the tail), and a run cut by the device's time limit
    # leaves what it had logged in the pack (95a3076's first step outlasted its call).
    out.mkdir(parents=True, exist_ok=True)
    disk_free_gib = round(shutil.disk_usage(out).free / 2**30, 1)
    print(f"s = {staleness}: {disk_free_gib} GiB free on {out}'s disk", flush=True)
    log_path = out / "trainer.log"
    start = time.perf_counter()
    sampler = BusySampler(out / "gpu_busy.json", metrics=out / "metrics.jsonl", warmup=args.warmup)
    with sampler as busy, log_path.open("w") as log:
        returncode = subprocess.run(
            command, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT
        ).returncode
    wall_s = time.perf_counter() - start
    checkpoints = drop_checkpoints(out / "checkpoints")
    # The commit each run ran at (gpu_checks/background.sh's caller exports it): runs of one
    # report can come from several device calls (--earlier).
    commit = os.environ.get("YATT_COMMIT", "")
    result = {"staleness": staleness, "rc": returncode, "wall_s": wall_s, "commit": commit}
    result |= {"checkpoints": checkpoints, "disk_free_gib_before": disk_free_gib}
    if returncode != 0:
        return result | {"log_tail": log_path.read_text(errors="replace")[-3000:]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return result | summarize(rows, staleness, warmup=args.warmup) | {"gpu_busy": busy.fraction}


def drop_checkpoints(folder: Path) -> list[str]:
    """The names of the checkpoints a run committed, then the folder deleted: the next run
    needs the disk, and the bench only needs to know the saves happened."""
    if not folder.is_dir():
        return []
    names = sorted(p.name for p in folder.iterdir() if p.is_dir())
    shutil.rmtree(folder)
    return names


def summarize(rows: list[dict], staleness: int, *, warmup: int) -> dict:
    """Step time, the rollout wait, the staleness histogram, IS by age, the reward curve."""
    timed = rows[warmup:] or rows
    step_s = [
        sum(v for k, v in r.items() if k.startswith("time/") and k != "time/genrm_tail_s")
        for r in timed
    ]
    ages = range(staleness + 1)
    # s = 0 runs today's on-policy step, which logs no offpolicy/* keys: every token is age 0,
    # said as such (None) rather than as an empty histogram ({0: 0.0}, session 24).
    is_offpolicy = any("offpolicy/tokens_age_0" in r for r in rows)
    histogram = (
        {a: sum(r.get(f"offpolicy/tokens_age_{a}", 0.0) for r in rows) for a in ages}
        if is_offpolicy
        else None
    )
    tokens_per_s = [
        r["train/num_loss_tokens"] / step for r, step in zip(timed, step_s, strict=True)
        if "train/num_loss_tokens" in r and step > 0
    ]  # fmt: skip
    is_mean = {
        a: statistics.mean(r[f"offpolicy/is_weight_mean_age_{a}"] for r in rows if r.get(f"offpolicy/tokens_age_{a}"))
        for a in ages
        if any(r.get(f"offpolicy/tokens_age_{a}") for r in rows)
    }  # fmt: skip
    return {
        "lengths": length_summary(rows),
        "num_steps": len(rows),
        "step_s_median": statistics.median(step_s),
        "step_s_min": min(step_s),
        "step_s_max": max(step_s),
        # Loss tokens trained per second of step: step time alone compares runs only while
        # their lengths agree (a coin reward moves them: the H200 runs at 2386771).
        "loss_tokens_per_s": (
            {
                "median": statistics.median(tokens_per_s),
                "min": min(tokens_per_s),
                "max": max(tokens_per_s),
            }
            if tokens_per_s
            else None
        ),
        "take_wait_s_median": statistics.median(r.get("offpolicy/take_wait_s", 0.0) for r in timed),
        "tokens_by_age": histogram,
        "tokens_over_bound": sum(r.get("offpolicy/tokens_over_bound", 0.0) for r in rows),
        "is_weight_mean_by_age": is_mean,
        "is_resident": rows[-1].get("offpolicy/is_resident"),
        "reward_curve": [r["reward/mean"] for r in rows],
    }


LENGTH_KEYS = {
    "median": "response/length_p50",
    "p90": "response/length_p90",
    "max": "response/length_max",
    "at_cap": "response/truncated_frac",
}


def length_summary(rows: list[dict]) -> dict[str, dict[str, float]]:
    """The response lengths the trainer logged (its trained responses, every step): over the
    run (median of the steps' medians and p90s, the largest max, the mean fraction at the cap),
    and at the first and last steps (did training move them?)."""
    run = {
        "median": statistics.median(r[LENGTH_KEYS["median"]] for r in rows),
        "p90": statistics.median(r[LENGTH_KEYS["p90"]] for r in rows),
        "max": max(r[LENGTH_KEYS["max"]] for r in rows),
        "at_cap": statistics.mean(r[LENGTH_KEYS["at_cap"]] for r in rows),
    }
    step = {name: {k: rows[i][key] for k, key in LENGTH_KEYS.items()} for name, i in
            (("first", 0), ("last", -1))}  # fmt: skip
    return {"run": run, **step}


def _lengths_cell(lengths: dict[str, float]) -> str:
    return (
        f"{lengths['median']:.0f} / {lengths['p90']:.0f} / {lengths['max']:.0f} / "
        f"{lengths['at_cap']:.1%}"
    )


def _tokens_per_s(run: dict) -> float | None:
    return (run.get("loss_tokens_per_s") or {}).get("median")


def ratios(runs: dict[int, dict]) -> dict[str, float | None]:
    """Step time of s over s = 0, and loss tokens per second of s = 0 over s (below 1: s
    trains faster), each a ratio of medians."""
    base = runs.get(0, {}).get("step_s_median")
    out = {
        f"step_s_s{s}_over_s0": (runs[s]["step_s_median"] / base if base else None)
        for s in STALENESS[1:]
        if runs.get(s, {}).get("step_s_median") is not None
    }
    base_rate = _tokens_per_s(runs.get(0, {}))
    for s in STALENESS[1:]:
        rate = _tokens_per_s(runs.get(s, {}))
        if rate:
            out[f"token_time_s{s}_over_s0"] = base_rate / rate if base_rate else None
    return out


def markdown(results: dict) -> str:
    lines = [
        f"# Off-policy steps (issue 48): {results['device']}",
        "",
        "| s | rc | steps | step s median (min-max) | loss tokens/s median (min-max) | "
        "rollout wait s | GPU busy | tokens by age | over bound | IS mean by age | resident | "
        "reward first -> last |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s, run in sorted(results["runs"].items()):
        if run.get("rc"):
            lines.append(f"| {s} | {run['rc']} | | | | | | | | | | |")
            continue
        busy = run["gpu_busy"]
        curve = run["reward_curve"]
        step = f"{run['step_s_median']:.3f}"
        if "step_s_min" in run:  # runs summarized before min/max were kept have a median only
            step += f" ({run['step_s_min']:.3f}-{run['step_s_max']:.3f})"
        rate = run.get("loss_tokens_per_s")
        rate = f"{rate['median']:.0f} ({rate['min']:.0f}-{rate['max']:.0f})" if rate else "-"
        lines.append(
            f"| {s} | 0 | {run['num_steps']} | {step} | {rate} | "
            f"{run['take_wait_s_median']:.3f} | {'-' if busy is None else f'{busy:.2f}'} | "
            f"{'on-policy: all age 0' if run['tokens_by_age'] is None else run['tokens_by_age']} | "
            f"{run['tokens_over_bound']:.0f} | "
            f"{ {a: round(v, 3) for a, v in run['is_weight_mean_by_age'].items()} } | "
            f"{run['is_resident']} | {curve[0]:.3f} -> {curve[-1]:.3f} |"
        )
    lines += [
        "",
        "Response lengths (tokens; the trainer's response/length_p50, _p90, _max and "
        "truncated_frac): median / p90 / max / at the cap. Run: median of the steps' median "
        "and p90, largest max, mean at-cap fraction.",
        "",
        "| s | run | first step | last step |",
        "|---|---|---|---|",
    ]
    asked = results.get("length_mix")
    if asked:
        lines.append(f"| asked ({results['args']['length_mix']}) | {_lengths_cell(asked)} | | |")
    for s, run in sorted(results["runs"].items()):
        if not run.get("rc"):
            cells = [_lengths_cell(run["lengths"][k]) for k in ("run", "first", "last")]
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += reward_windows(results["runs"])
    cells = []
    for prefix, name in (("step_s", "step time"), ("token_time", "time per loss token")):
        for s in STALENESS[1:]:
            key = f"{prefix}_s{s}_over_s0"
            if key in results.get("ratios", {}):
                value = results["ratios"][key]
                cells.append(
                    f"{name} s = {s} / s = 0: " + ("n/a" if value is None else f"{value:.3f}")
                )
    lines += ["", "Ratios of medians: " + ("; ".join(cells) or "none") + "."]
    lines.append(
        f"Two engines at once / one after the other on one H200: {ONE_GPU_OVERLAP} "
        "(engines_overlap_nvidia_h200.md): what overlapping rollout and judge alone gives."
    )
    busy0 = results["runs"].get(0, {}).get("gpu_busy")
    if busy0 is not None:
        # s >= 1 overlaps the trainer with the engines too, so the engines' 0.84 is no bound
        # for it; filling s = 0's idle GPU time is (while kernels do not run side by side).
        lines.append(
            f"One-GPU bound for s >= 1, s = 0's step with its idle GPU time filled (its GPU "
            f"busy fraction): {busy0:.2f} of s = 0's step time."
        )
    commits = {s: run.get("commit") for s, run in sorted(results["runs"].items())}
    if any(commits.values()):
        lines.append(
            "Commits: " + ", ".join(f"s = {s} at {c or '?'}" for s, c in commits.items()) + "."
        )
    return "\n".join(lines)


REWARD_WINDOW = 10  # steps per cell of the report's reward curve


def reward_windows(runs: dict[int, dict]) -> list[str]:
    """The reward curves in the report itself, as means over REWARD_WINDOW steps: a report
    printed by a device call outlives its JSON (the H200 run at 3991ef1 lost its files)."""
    curves = {s: run["reward_curve"] for s, run in sorted(runs.items()) if not run.get("rc")}
    if not curves:
        return []
    longest = max(len(c) for c in curves.values())
    starts = range(0, longest, REWARD_WINDOW)
    header = [f"{a}-{min(a + REWARD_WINDOW, longest) - 1}" for a in starts]
    lines = [
        "",
        f"Reward (reward/mean) by {REWARD_WINDOW}-step window, mean over the window's steps:",
        "",
        "| s | " + " | ".join(header) + " |",
        "|---|" + "---|" * len(header),
    ]
    for s, curve in curves.items():
        cells = [curve[a : a + REWARD_WINDOW] for a in starts]
        text = [f"{sum(c) / len(c):.3f}" if c else "" for c in cells]
        lines.append(f"| {s} | " + " | ".join(text) + " |")
    return lines


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--smoke", action="store_true", help="the embedded task on the CPU")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (100; smoke 4)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the median")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (16; smoke 4)")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument(
        "--length-mix",
        choices=("longtail", "cap"),
        default="longtail",
        help="random policy's lengths: the long-tail mix (_longtail_policy.py) or all at the cap",
    )
    parser.add_argument("--staleness", type=int, nargs="+", default=list(STALENESS))
    parser.add_argument(
        "--placement",
        choices=("partial", "separate"),
        default="partial",
        help="partial: trainer, rollout and judge on one GPU; separate: the engines on a second "
        "GPU (two visible; issue 48's several-GPU bar, s = 1 step time <= 0.6x s = 0)",
    )
    parser.add_argument(
        "--judge-reasoning-median",
        type=int,
        default=32,
        help="tokens the shaped judge reasons before its verdict (median; geometric)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=1e-7,
        help="the policy's learning rate (GPU runs). Under Adam a coin reward walks the "
        "lengths away from the mix: at 1e-6 s = 0's mean fell 54 -> 21 tokens and s = 1's "
        "rose 51 -> 217 over 100 steps (H200, 2386771)",
    )
    parser.add_argument(
        "--earlier",
        default="",
        help="a report JSON whose runs are kept (those of --staleness run again), e.g. a "
        "committed bench/results/offpolicy_nvidia_h200.json; default: OUT's own",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="the GPU runs' setup at 2-layer shapes (CPU check)"
    )
    parser.add_argument(
        "extra", nargs="*", help="more trainer overrides, e.g. rollout.samples_per_prompt=8"
    )
    args = parser.parse_args(argv)
    if args.earlier and not Path(args.earlier).is_file():
        parser.error(f"--earlier {args.earlier}: no such file (a report JSON this bench wrote)")
    args.steps = args.steps or (4 if args.smoke else 100)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    args.prompts = args.prompts or (4 if args.smoke else 16)
    if not args.smoke and args.length_mix == "longtail":
        longtail.LengthMix(cap=args.max_new_tokens)  # a bad cap fails before any model is built
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    base = prepare(args)
    results: dict = {"device": device_name(), "args": vars(args), "runs": {}}
    if not args.smoke and args.length_mix == "longtail":  # what the shaped policy is built for
        results["length_mix"] = longtail.LengthMix(cap=args.max_new_tokens).summary()
    name = (
        "offpolicy_cpu_smoke"
        if args.smoke
        else f"offpolicy_{results['device'].split()[-1].lower()}"
    )
    if args.placement == "separate":  # its own report: the one-GPU runs are not its baseline
        name += "_separate"
    earlier = Path(args.earlier) if args.earlier else Path(args.out_dir) / f"{name}.json"
    if earlier.is_file():  # an earlier call's runs (one s per device call), kept
        saved = json.loads(earlier.read_text())["runs"]
        results["runs"] = {int(s): run for s, run in saved.items()}
    for staleness in args.staleness:
        results["runs"][staleness] = run_one(staleness, base, args)
        results["ratios"] = ratios(results["runs"])
        write_report(Path(args.out_dir) / f"{name}.md", markdown(results), data=results)
    print(markdown(results))


if __name__ == "__main__":
    main(sys.argv[1:])
