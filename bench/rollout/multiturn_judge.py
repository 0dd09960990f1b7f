"""Issue 44's second bar: rollout + judge time per kept group for multi-turn trajectories, partial
colocation (each trajectory judged as it ends, genrm.TrajectoryStream, the tail cut once the
batch is full) against full colocation (each round's trajectories all end, then the judge).

    python3 bench/rollout/multiturn_judge.py --out-dir OUT   # 0.5B policy + 1.5B judge, GPU
    python bench/rollout/multiturn_judge.py --smoke --out-dir /tmp/x   # tiny shapes on CPU

Workload: rows of --samples trajectories each; trajectory (row, sample) takes 1 to 6 turns
drawn from a long-tailed distribution (TURN_WEIGHTS: most end after 1-2 turns, a few run 6),
fixed by --seed so both modes see the same trajectories. A turn samples --response-tokens
forced tokens (ignore_eos) in the policy's built-in engine, its KV kept between turns
(Request.session_id); between turns a tool takes --tool-s seconds and returns a
--observation-tokens observation (random ids) appended as prompt tokens. The environment's
reward is 0 or 1 per trajectory (seeded), so about 1 - 2 / 2^samples of the groups vary. The
judge (its own built-in engine on the same GPU) reads each trajectory's ids and writes
--verdict-tokens forced tokens: its cost is a real judge's (prefill the transcript, decode a
verdict); its verdict text is not read (random weights).

    partial  genrm.TrajectoryStream.run: --oversample x --groups rows fed at once, each
             trajectory to the judge as it ends, whole groups with reward variance kept; once
             --groups are kept the trajectories still running are cut
    full     rounds: draw ceil(missing / keep rate) rows, every trajectory to its end, then the
             judge over all of them in one batch, keep; rounds until --groups are kept (both
             engines resident: no sleep or wake is timed, which favours this mode)

Time per kept group = the mode's wall time / its kept groups; bar: partial / full <= 0.8.
Both modes use the same package pieces (TrajectoryStream, the built-in engines); only the
driver of turns is this script's (a forced token-level environment: random-weight models write
no tool calls). One untimed pass of each mode first, then --repeats passes alternating; medians.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from _engine_shapes import SHAPES
from compile_scope import add_compile_scope_argument, scope_mark
from device_label import device_name
from measured_commit import measured_commit
from report import write_report

BAR = 0.8
MODES = ("full", "partial")
TURN_WEIGHTS = (0.35, 0.25, 0.15, 0.1, 0.08, 0.07)  # P(1 turn) .. P(6 turns): a long tail
TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
)  # fmt: skip


def trajectory_plan(args: argparse.Namespace, row: int, sample: int) -> tuple[int, float]:
    """(turns, environment reward) of trajectory (row, sample): the same in both modes."""
    rng = random.Random(args.seed * 1_000_003 + row * 1009 + sample)
    turns = rng.choices(range(1, len(TURN_WEIGHTS) + 1), weights=TURN_WEIGHTS)[0]
    return turns, float(rng.random() < 0.5)


def context_tokens(args: argparse.Namespace) -> int:
    """The longest trajectory: prompt + 6 turns + 5 observations."""
    turns = len(TURN_WEIGHTS)
    return args.prompt_tokens + turns * args.response_tokens + (turns - 1) * args.observation_tokens


def _random_ids(seed: int, count: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count,), generator=g).tolist()


class ForcedMultiTurn:
    """MultiTurnRollout's stream() contract over forced turns (see the module docstring): each
    trajectory its own task, its next turn in the engine as soon as its tool returns."""

    def __init__(self, engine, args: argparse.Namespace, vocab: int, tag: str) -> None:
        self.engine, self.args, self.vocab, self.tag = engine, args, vocab, tag
        self.config = SimpleNamespace(max_trajectory_tokens=context_tokens(args))
        self.ids: dict[str, list[int]] = {}  # "row/sample" -> prompt + response ids (the judge)

    async def stream(self, rows, sampling, *, stats=None, first_row_index=0):
        tasks = [
            asyncio.create_task(self._one(i, j, row))
            for i, row in enumerate(rows, start=first_row_index)
            for j in range(sampling.n)
        ]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, row_index: int, sample: int, row: dict):
        from yatt.rollout import Request, SamplingParams, Trajectory

        args = self.args
        turns, reward = trajectory_plan(args, row["id"], sample)
        prompt = _random_ids(args.seed + row["id"], args.prompt_tokens, self.vocab)
        response: list[int] = []
        mask: list[int] = []
        session = f"{self.tag}-{row_index}-{sample}"
        try:
            for turn in range(turns):
                request = Request(
                    prompt_ids=prompt + response,
                    session_id=session,
                    max_new_tokens=args.response_tokens,
                )
                sampling = SamplingParams(
                    temperature=1.0,
                    max_new_tokens=args.response_tokens,
                    ignore_eos=True,
                    seed=args.seed + 7919 * row["id"] + 31 * sample + turn,
                )
                stream = self.engine.stream([request], sampling)
                try:
                    async for completion in stream:
                        last = completion
                finally:
                    await stream.aclose()
                response += last.response_ids
                mask += [1] * len(last.response_ids)
                if turn + 1 < turns:
                    await asyncio.sleep(args.tool_s)  # the tool's own time
                    seed = args.seed + 100_003 * (turn + 1) + 1009 * row["id"] + sample
                    observation = _random_ids(seed, args.observation_tokens, self.vocab)
                    response += observation
                    mask += [0] * len(observation)
        finally:
            self.engine.release_sessions([session])
        key = f"{row_index}/{sample}"
        self.ids[key] = prompt + response
        return Trajectory(
            row_index=row_index,
            sample_index=sample,
            env_name="forced",
            prompt_ids=prompt,
            response_ids=response,
            loss_mask=mask,
            logprobs=[0.0] * len(response),
            messages=[{"role": "user", "content": key}],
            tool_calls=[[] for _ in range(turns)],
            num_turns=turns,
            end_cause="stop",
            env_reward=reward,
            row=row,
        )


class TokenJudge:
    """A scorer over trajectory ids: the judge engine prefills each one and writes
    --verdict-tokens forced tokens; reward 0 (the environment's reward is the signal)."""

    def __init__(self, engine, multiturn: ForcedMultiTurn, verdict_tokens: int) -> None:
        self.engine, self.multiturn, self.verdict_tokens = engine, multiturn, verdict_tokens

    def _requests(self, samples):
        from yatt.rollout import Request

        return [Request(prompt_ids=self.multiturn.ids[s.prompt]) for s in samples]

    def _sampling(self):
        from yatt.rollout import SamplingParams

        return SamplingParams(
            temperature=0.0, max_new_tokens=self.verdict_tokens, ignore_eos=True, seed=0
        )

    def _verdicts(self, samples):
        from yatt.genrm import Verdict

        return [Verdict(sample_id=s.id, reward=0.0, status="ok") for s in samples]

    async def ascore(self, samples):
        async for _ in self.engine.stream(self._requests(samples), self._sampling()):
            pass
        return self._verdicts(samples)

    def score(self, samples, *, should_stop=None):
        self.engine.generate(self._requests(samples), self._sampling())
        return self._verdicts(samples)


def _varies(group) -> bool:
    return len({j.verdict.reward for j in group}) > 1


class _StreamSampler:
    """Stream mode's contract (core.DynamicSampler's): one draw, full at --groups kept."""

    def __init__(self, num_rows: int, target: int) -> None:
        self.to_draw, self.target, self.kept = num_rows, target, []

    def num_to_draw(self, *, in_flight: int) -> int:
        count, self.to_draw = self.to_draw, 0
        return count

    def should_abort(self) -> bool:
        return len(self.kept) >= self.target

    def keep(self, group) -> None:
        if _varies(group) and len(self.kept) < self.target:
            self.kept.append(group)


def _rows(first: int, count: int) -> list[dict]:
    return [{"id": i, "prompt": f"row {i}"} for i in range(first, first + count)]


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def run_partial(policy, judge, args, vocab: int, tag: str) -> dict:
    from yatt import genrm
    from yatt.rollout import SamplingParams

    multiturn = ForcedMultiTurn(policy, args, vocab, tag)
    stream = genrm.TrajectoryStream(
        multiturn=multiturn,
        scorer=TokenJudge(judge, multiturn, args.verdict_tokens),
        sampling=SamplingParams(n=args.samples, max_new_tokens=args.response_tokens),
        to_row=lambda row: row,
        answer_key="",
        env_reward_weight=1.0,
        judge_engine=judge,
    )
    sampler = _StreamSampler(args.oversample * args.groups, args.groups)
    rows = iter(_rows(0, 10**6))
    _sync()
    start = time.perf_counter()
    asyncio.run(
        stream.run(sampler, draw=lambda k: [next(rows) for _ in range(k)], keep=sampler.keep)
    )
    _sync()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "kept": len(sampler.kept),
        "num_rows": len(stream.payloads),
        "num_trajectories": stream.turn_stats.num_trajectories,
        "num_groups_cut": stream.num_groups_cut,
    }


def run_full(policy, judge, args, vocab: int, tag: str) -> dict:
    from yatt import genrm
    from yatt.rollout import SamplingParams

    sampling = SamplingParams(n=args.samples, max_new_tokens=args.response_tokens)
    keep_rate = 1.0 - 2.0 / 2**args.samples  # P(a group's 0/1 rewards vary)
    kept, first_row, num_trajectories, num_rounds = 0, 0, 0, 0
    _sync()
    start = time.perf_counter()
    while kept < args.groups and num_rounds < 8:
        num_rows = math.ceil((args.groups - kept) / keep_rate)
        rows = _rows(first_row, num_rows)
        first_row += num_rows
        num_rounds += 1
        multiturn = ForcedMultiTurn(policy, args, vocab, f"{tag}-{num_rounds}")
        trajectories, _ = asyncio.run(_collect(multiturn, rows, sampling))
        num_trajectories += len(trajectories)
        judged = genrm.score_trajectories(  # the judge after the round: one batch
            trajectories,
            [SimpleNamespace(row=row) for row in rows],
            TokenJudge(judge, multiturn, args.verdict_tokens),
            answer_key="",
            env_reward_weight=1.0,
        )
        groups: dict[int, list] = {}
        for item in judged:
            groups.setdefault(item.completion.request_index, []).append(item)
        kept += min(sum(_varies(g) for g in groups.values()), args.groups - kept)
    _sync()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "kept": kept,
        "num_rows": first_row,
        "num_trajectories": num_trajectories,
        "num_rounds": num_rounds,
    }


async def _collect(multiturn, rows, sampling):
    out = [t async for t in multiturn.stream(rows, sampling)]
    out.sort(key=lambda t: (t.row_index, t.sample_index))
    return out, None


RUNS = {"full": run_full, "partial": run_partial}


def build_engine(shape: dict, args: argparse.Namespace, *, max_batch_size: int, seed: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from yatt.rollout import BuiltinEngine, EngineConfig

    device = "cpu" if args.smoke else "cuda"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            Qwen2Config(**shape),
            dtype=torch.float32 if args.smoke else torch.bfloat16,
            attn_implementation="sdpa",
        )
    model = model.eval().requires_grad_(False)
    config = EngineConfig(
        device=device,
        compile_scope=args.compile_scope,
        dtype="float32" if args.smoke else "bfloat16",
        max_batch_size=max_batch_size,
        max_seq_len=context_tokens(args) + args.verdict_tokens + 8,
    )
    return BuiltinEngine(model, config=config)


def progress(line: str) -> None:
    """A phase and its time, as it ends: a run killed at its limit still says where it was."""
    print(f"  {line}", flush=True)


def error_row(exc: BaseException) -> dict:
    """What failed, down to the first cause (an engine's failure reaches the stream as a
    RuntimeError whose __cause__ holds the real one); the whole chain goes to stderr."""
    from yatt.genrm import describe_failure  # the chain as verdict errors give it

    traceback.print_exception(exc, file=sys.stderr)
    return {"error": describe_failure(exc)[:1000]}


def measure(args: argparse.Namespace) -> dict:
    policy_shape = TINY if args.smoke else SHAPES[args.policy]
    judge_shape = TINY if args.smoke else SHAPES[args.judge]
    slots = args.oversample * args.groups * args.samples
    start = time.perf_counter()
    policy = build_engine(policy_shape, args, max_batch_size=slots, seed=0)
    judge = build_engine(judge_shape, args, max_batch_size=slots, seed=1)
    progress(f"engines built: {time.perf_counter() - start:.1f} s")
    vocab = policy_shape["vocab_size"]
    try:
        for mode in MODES:  # untimed: kernels loaded, CUDA graphs captured
            start = time.perf_counter()
            RUNS[mode](policy, judge, args, vocab, f"warm-{mode}")
            progress(f"warm-up {mode}: {time.perf_counter() - start:.1f} s")
        passes: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(args.repeats):
            for mode in MODES:
                passes[mode].append(RUNS[mode](policy, judge, args, vocab, f"{mode}-{r}"))
                row = passes[mode][-1]
                progress(f"{mode} pass {r}: {row['seconds']:.2f} s, {row['kept']} kept")
    finally:
        for engine in (policy, judge):
            engine.close()
        del policy, judge
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    per_group = {
        m: statistics.median(p["seconds"] / max(p["kept"], 1) for p in passes[m]) for m in MODES
    }
    return {
        "seconds_per_kept_group": per_group,
        "ratio": per_group["partial"] / per_group["full"],
        "passes": passes,
    }


def markdown(results: dict) -> str:
    w = results["workload"]
    lines = [
        "# Multi-turn rollout + judge per kept group: judged as each trajectory ends (partial "
        f"colocation) vs after the rollout (full), issue 44, {results['device']}",
        "",
        f"commit: {results['commit']} · GPU: {results['device']} · built-in engines, policy "
        f"{w['policy']}, judge {w['judge']} (random-weight Qwen2.5 shapes), "
        f"{w['groups']} kept groups of {w['samples']} trajectories, 1-6 turns "
        f"(weights {list(TURN_WEIGHTS)}), prompt {w['prompt_tokens']}, {w['response_tokens']} "
        f"forced tokens per turn, {w['observation_tokens']}-token observations, tool "
        f"{w['tool_s']} s, verdict {w['verdict_tokens']} tokens, partial oversample "
        f"{w['oversample']}; median of {w['repeats']} passes per mode"
        + (" · SMOKE (tiny shapes, CPU): not a measurement" if results["smoke"] else ""),
        "",
    ]
    row = results.get("row", {})
    if "error" in row:
        lines.append(f"error: {row['error'][:300]}")
    elif row:
        s, ratio = row["seconds_per_kept_group"], row["ratio"]
        verdict = "PASS" if ratio <= BAR else "FAIL"
        last = {m: row["passes"][m][-1] for m in MODES}
        lines += [
            "| full s/group | partial s/group | partial / full | bar | rows drawn (full / "
            "partial) | groups cut (partial) |",
            "|---:|---:|---:|---|---|---:|",
            f"| {s['full']:.3f} | {s['partial']:.3f} | {ratio:.3f} | <= {BAR} {verdict} | "
            f"{last['full']['num_rows']} / {last['partial']['num_rows']} | "
            f"{last['partial']['num_groups_cut']} |",
        ]
    lines += ["", f"Command: `{results['command']}`"]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", choices=tuple(SHAPES), default="0.5b", help="policy shape")
    p.add_argument("--judge", choices=tuple(SHAPES), default="1.5b", help="judge shape")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (the plumbing only)")
    p.add_argument("--groups", type=int, default=16, help="kept groups per pass")
    p.add_argument("--samples", type=int, default=4, help="trajectories per row (group size)")
    p.add_argument("--oversample", type=int, default=2, help="partial: rows fed per kept group")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=128, help="forced, per turn")
    p.add_argument("--observation-tokens", type=int, default=256)
    p.add_argument("--verdict-tokens", type=int, default=8)
    p.add_argument("--tool-s", type=float, default=0.05, help="a tool call's own time")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per mode")
    p.add_argument("--seed", type=int, default=0)
    add_compile_scope_argument(p, named="the report is named _clayers")
    p.add_argument("--out-dir", default="bench/results")
    args = p.parse_args(argv)
    if args.tool_s < 0:
        p.error(f"--tool-s {args.tool_s}: must be >= 0")
    if args.smoke:
        for name, small in (
            ("groups", 2),
            ("prompt_tokens", 8),
            ("response_tokens", 4),
            ("observation_tokens", 4),
            ("verdict_tokens", 2),
            ("repeats", 1),
        ):
            setattr(args, name, min(getattr(args, name), small))
        args.tool_s = 0.0
        args.policy = args.judge = "tiny"
    for name in ("groups", "oversample", "prompt_tokens", "response_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.samples < 2:
        p.error(f"--samples {args.samples}: must be >= 2 (a group of one has no variance)")
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA device: run with --smoke on CPU")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.smoke:
        torch.set_num_threads(1)
    device = device_name()
    md = (
        Path(args.out_dir)
        / f"multiturn_judge_{device}{'_smoke' if args.smoke else ''}{scope_mark(args.compile_scope)}.md"
    )
    keys = (
        *("policy", "judge", "groups", "samples", "oversample", "prompt_tokens"),
        *(
            "response_tokens",
            "observation_tokens",
            "verdict_tokens",
            "tool_s",
            "repeats",
            "seed",
            "compile_scope",
        ),
    )
    results = {
        "commit": measured_commit(["bench", "packages"]),
        "device": device,
        "smoke": args.smoke,
        "workload": {k: getattr(args, k) for k in keys},
        "bar": BAR,
        "command": "python3 bench/rollout/multiturn_judge.py " + " ".join(argv),
    }
    try:
        results["row"] = measure(args)
    except Exception as exc:  # the report says what failed, with its causes
        results["row"] = error_row(exc)
    write_report(md, markdown(results), data=results)
    print(f"=== {results['row'].get('ratio', results['row'])}", flush=True)
    print(f"wrote {md}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
