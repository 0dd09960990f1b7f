"""Issue 44's first bar: multi-turn rollout time with the conversation's KV kept in the built-in
engine between turns (Request.session_id) against prefilling the whole history every turn.

    python3 bench/rollout/multiturn_kv.py --out-dir OUT     # 0.5b and 1.5b on the GPU
    python bench/rollout/multiturn_kv.py --smoke --out-dir /tmp/x   # tiny shape on CPU: plumbing

Workload (the bar's): --trajectories conversations at once, each --turns turns; a turn samples
--response-tokens forced tokens (ignore_eos, temperature 1, seeded), then a --observation-tokens
observation (random ids: a tool's result) is appended as prompt tokens for the next turn. Both
modes send the same requests turn by turn (one generate call per turn, every trajectory in it)
to ONE engine (same weights, same CUDA graphs): `kept` names each trajectory's session, so the
engine prefills only the new tokens (response already cached, observation); `prefill` sends the
same prompt ids without a session, so the engine prefills the whole history again. Rollout time
= the sum of the turns' generate calls (the tool's own time left out: it is the same in both).
Per shape: one untimed two-turn round of each mode first (graph capture, compiles), then
--repeats rounds alternating prefill and kept; medians. Bar: kept / prefill <= 0.6. Each
phase's seconds are printed as it ends and kept in the JSON (setup_s).

--vllm adds issue 44's third bar in the same run: after the built-in engine's rounds (closed
first), yatt's VLLMEngine adapter (vLLM 0.26, prefix caching on, CUDA graphs, max_num_seqs =
--trajectories, max_model_len = the built-in engine's max_seq_len) over the same weights (saved
once to a temporary folder with a byte tokenizer) gets the same requests turn by turn; vLLM has
no sessions, so its prefix cache is what keeps the history. Bar: yatt kept / vLLM <= 1.0.
Needs vLLM's site on the path (bench/rollout/engines_gpu.sh unpack; scripts/pack_engine_site.sh).

The JSON (and markdown) is rewritten after every shape, so a run cut short keeps the shapes it
finished. Random-weight Qwen2.5 shapes (bench/rollout/_engine_shapes.py), built on the device in
bf16: no files written.
"""

from __future__ import annotations

import argparse
import fcntl
import gc
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from _engine_shapes import SHAPES
from compile_scope import add_compile_scope_argument, scope_mark
from device_label import device_name
from measured_commit import measured_commit
from report import write_report

BAR = 0.6
READY_WAIT_S = 600  # how long a shape's process waits for the others' setups
VLLM_BAR = 1.0  # yatt kept / vLLM with prefix caching, the same requests
VLLM_MEMORY = 0.3  # vLLM's share of the GPU: the bench's KV needs a few GiB at most
MODES = ("prefill", "kept")
TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
)  # fmt: skip


def build_model(shape: dict, args: argparse.Namespace):
    """The shape's random weights (seed 0): the same tensors for every engine of the run."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            Qwen2Config(**shape), dtype=dtype, attn_implementation="sdpa"
        )
    return model.eval().requires_grad_(False)


def build_engine(shape: dict, args: argparse.Namespace):
    from yatt.rollout import BuiltinEngine, EngineConfig

    device = "cpu" if args.smoke else "cuda"
    model = build_model(shape, args)
    config = EngineConfig(
        device=device,
        compile_scope=args.compile_scope,
        dtype="float32" if args.smoke else "bfloat16",
        max_batch_size=args.trajectories,
        max_seq_len=context_tokens(args) + 8,
        # Every trajectory decodes the same forced length, so only the full batch ever runs:
        # one CUDA graph per span instead of four (setup time, the same in both modes).
        decode_batch_buckets=(),
        **({"max_prefill_tokens": args.max_prefill_tokens} if args.max_prefill_tokens else {}),
    )
    return BuiltinEngine(model, config=config)


def build_vllm_engine(shape: dict, args: argparse.Namespace, folder: Path):
    """yatt's VLLMEngine over the shape's weights, saved to `folder` first (vLLM loads a
    folder); prefix caching on, as the bar names it (vLLM's default, set explicitly)."""
    from yatt.rollout import VLLMConfig, VLLMEngine
    from yatt.testing import make_tokenizer

    model = build_model(shape, args)
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    config = VLLMConfig(
        dtype="bfloat16",
        gpu_memory_utilization=VLLM_MEMORY,
        max_model_len=context_tokens(args) + 8,
        llm_kwargs={"max_num_seqs": args.trajectories, "enable_prefix_caching": True},
    )
    return VLLMEngine(folder, config=config)


def context_tokens(args: argparse.Namespace) -> int:
    """The last turn's prompt + its response."""
    per_turn = args.response_tokens + args.observation_tokens
    return args.prompt_tokens + (args.turns - 1) * per_turn + args.response_tokens


def first_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(3, vocab, (args.trajectories, args.prompt_tokens), generator=g)
    return ids.tolist()


def observations(args: argparse.Namespace, vocab: int, turn: int) -> list[list[int]]:
    """The observation appended after `turn`'s response, per trajectory (the same in both modes)."""
    g = torch.Generator().manual_seed(args.seed + 1000 * (turn + 1))
    ids = torch.randint(3, vocab, (args.trajectories, args.observation_tokens), generator=g)
    return ids.tolist()


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def rollout(
    engine,
    args: argparse.Namespace,
    vocab: int,
    mode: str,
    round_index: int,
    turns: int = 0,
    profile_last: bool = False,
) -> dict:
    """One round of every trajectory through `turns` turns (0: --turns): per-turn seconds and
    checks. profile_last: the last turn samples one token (its time is the prefill, or the
    continuation, alone) under torch.profiler (its kernels by kind in "profile")."""
    from yatt.rollout import Request, SamplingParams

    histories = first_prompts(args, vocab)
    sessions = [f"r{round_index}-t{i}" for i in range(args.trajectories)]
    turn_s, kept, bad_lengths = [], [], 0
    turns = turns or args.turns
    for turn in range(turns):
        requests = [
            Request(prompt_ids=h, session_id=s if mode == "kept" else None)
            for h, s in zip(histories, sessions, strict=True)
        ]
        is_profiled = profile_last and turn == turns - 1
        sampling = SamplingParams(
            temperature=1.0,
            max_new_tokens=1 if is_profiled else args.response_tokens,
            ignore_eos=True,
            seed=args.seed + turn,
        )
        _sync()
        t0 = time.perf_counter()
        if is_profiled:
            profile, completions = profiled(lambda r=requests, s=sampling: engine.generate(r, s))
        else:
            completions = engine.generate(requests, sampling)
        _sync()
        turn_s.append(time.perf_counter() - t0)
        kept.append(getattr(engine, "num_kept_sessions", 0))  # vLLM: its prefix cache
        by_index = sorted(completions, key=lambda c: c.request_index)
        bad_lengths += sum(len(c.response_ids) != sampling.max_new_tokens for c in by_index)
        if turn + 1 < turns:
            obs = observations(args, vocab, turn)
            histories = [
                c.prompt_ids + c.response_ids + o for c, o in zip(by_index, obs, strict=True)
            ]
    if mode == "kept":
        engine.release_sessions(sessions)
    return {
        **({"profile": profile} if profile_last else {}),
        "seconds": sum(turn_s),
        "turn_s": turn_s,
        "kept_sessions_after_turn": kept,
        "bad_lengths": bad_lengths,
    }


def profiled(call) -> tuple[dict, object]:
    """call() under prefill_profile.profile_call (torch.profiler: the device kernels by kind,
    prefill's kinds first, the top kernels and host ops, kernel vs wall time) and its result."""
    from prefill_profile import profile_call

    result = {}
    summary = profile_call(
        lambda: result.setdefault("out", call()), "cuda" if torch.cuda.is_available() else "cpu"
    )
    return {"wall_ms": summary.pop("wall_ms_profiled"), **summary}, result["out"]


def measure_shape(name: str, args: argparse.Namespace) -> dict:
    shape = TINY if args.smoke else SHAPES[name]
    # Phase seconds, printed as they end: a run cut by its step's time limit still says
    # where the time went (the 1.5B shape once did not finish inside 300 s).
    setup_s: dict[str, float] = {}
    t0 = time.perf_counter()

    def phase(label: str) -> None:
        nonlocal t0
        _sync()
        setup_s[label] = round(time.perf_counter() - t0, 2)
        print(f"  {name} {label}: {setup_s[label]:.1f} s", flush=True)
        t0 = time.perf_counter()

    engine = build_engine(shape, args)
    vocab = shape["vocab_size"]
    phase("build")
    try:
        # Untimed, two turns per mode: CUDA graphs captured, and the prefill, continuation and
        # decode compiled (all dynamic in the shapes, so later turns reuse them).
        for mode in MODES:
            rollout(engine, args, vocab, mode, round_index=-1 - MODES.index(mode), turns=2)
            phase(f"warm-up {mode}")
        rounds: dict[str, list[dict]] = {m: [] for m in MODES}
        with gpu_to_itself(args):
            phase("waiting for the GPU")
            for r in range(args.repeats):
                for mode in MODES:
                    rounds[mode].append(rollout(engine, args, vocab, mode, round_index=r))
            phase("timed rounds")
            if args.profile:  # the last turn's forward alone, each mode, profiled
                profiles = {
                    mode: rollout(engine, args, vocab, mode, round_index=100, profile_last=True)
                    for mode in MODES
                }
                phase("profiled rounds")
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    medians = {m: statistics.median(x["seconds"] for x in rounds[m]) for m in MODES}
    floor = None
    if args.profile and profiles["prefill"]["profile"].get("kernel_ms"):  # none on a CPU
        floor = kept_floor(args, medians["prefill"], profiles["prefill"]["profile"])
    vllm = measure_vllm(shape, args, phase) if args.vllm else None
    return {
        **({"vllm": vllm, "ratio_vllm": medians["kept"] / vllm["seconds"]} if vllm else {}),
        "shape": "tiny" if args.smoke else name,
        "seconds": medians,
        "ratio": medians["kept"] / medians["prefill"],
        **({"kept_floor": floor} if floor else {}),
        "turn_s_median": {
            m: [statistics.median(x["turn_s"][t] for x in rounds[m]) for t in range(args.turns)]
            for m in MODES
        },
        "kept_sessions_after_turn": {m: rounds[m][-1]["kept_sessions_after_turn"] for m in MODES},
        "bad_lengths": sum(x["bad_lengths"] for m in MODES for x in rounds[m]),
        "setup_s": setup_s,
        "rounds": rounds,
        **(
            {
                "last_forward": {
                    m: {"seconds": p["turn_s"][-1], **p["profile"]} for m, p in profiles.items()
                }
            }
            if args.profile
            else {}
        ),
    }


def kept_floor(args: argparse.Namespace, prefill_s: float, prefill_profile: dict) -> dict:
    """The lowest kept / prefilled ratio this workload allows, from the profiled prefill's own
    kernel rates: keeping the KV can save at most the prefilled forwards' extra kernel time,
    since decode and the call's host work are the same in both modes.

    The last turn's prefill (every trajectory's n-token history) gives two rates: its kernel
    time outside attention per token, and its attention time per causal query-key pair
    (n^2 / 2 a row). A prefilled turn t feeds n_t = prompt + t (response + observation)
    tokens a row; a kept turn t >= 1 feeds the response's last token (never fed) and the
    observation, new = observation + 1, after start = n_t - new kept positions, so its
    pairs are new (start + new / 2) a row. Floor seconds = prefilled seconds - (the prefilled
    forwards' kernels - the kept forwards' kernels), both at those rates."""
    rows, turns = args.trajectories, args.turns
    per_turn = args.response_tokens + args.observation_tokens
    lengths = [args.prompt_tokens + t * per_turn for t in range(turns)]
    attention_s = prefill_profile["kernel_ms_by_group"].get("attention", 0.0) / 1e3
    other_s = prefill_profile["kernel_ms"] / 1e3 - attention_s
    last = lengths[-1]
    per_token = other_s / (rows * last)
    per_pair = attention_s / (rows * last * last / 2)

    def forward_s(tokens: float, pairs: float) -> float:
        return rows * (tokens * per_token + pairs * per_pair)

    prefilled = [forward_s(n, n * n / 2) for n in lengths]
    new = args.observation_tokens + 1
    kept = prefilled[:1] + [forward_s(new, new * (n - new + new / 2)) for n in lengths[1:]]
    floor_s = prefill_s - (sum(prefilled) - sum(kept))
    return {
        "prefilled_forward_s": prefilled,
        "kept_forward_s": kept,
        "floor_s": floor_s,
        "floor_ratio": floor_s / prefill_s,
    }


def measure_vllm(shape: dict, args: argparse.Namespace, phase) -> dict:
    """The same rounds through yatt's VLLMEngine (no sessions: the prefix cache keeps the
    history): one untimed two-turn round, then --repeats rounds; the median and each round."""
    with tempfile.TemporaryDirectory() as folder:
        engine = build_vllm_engine(shape, args, Path(folder))
        phase("vllm build")
        try:
            rollout(engine, args, shape["vocab_size"], "prefill", round_index=-3, turns=2)
            phase("vllm warm-up")
            with gpu_to_itself(args):
                rounds = [
                    rollout(engine, args, shape["vocab_size"], "prefill", round_index=100 + r)
                    for r in range(args.repeats)
                ]
                phase("vllm timed rounds")
        finally:
            engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    return {
        "seconds": statistics.median(x["seconds"] for x in rounds),
        "turn_s_median": [
            statistics.median(x["turn_s"][t] for x in rounds) for t in range(args.turns)
        ],
        "bad_lengths": sum(x["bad_lengths"] for x in rounds),
        "rounds": rounds,
    }


@contextmanager
def gpu_to_itself(args: argparse.Namespace) -> Iterator[None]:
    """In a shape's own process (--child): wait until every shape's process has set up
    (compiled, captured, warmed up: CPU-bound work, done side by side), then measure alone,
    one process at a time (a file lock), so no compile or other process's GPU work overlaps
    a timed round. In-process runs measure at once."""
    if args.sync_dir is None:
        yield
        return
    sync = Path(args.sync_dir)
    (sync / f"ready-{args.child}").touch()
    deadline = time.monotonic() + READY_WAIT_S
    while len(list(sync.glob("ready-*"))) < args.num_children and time.monotonic() < deadline:
        time.sleep(0.2)
    with open(sync / "gpu.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def measure_in_children(args: argparse.Namespace, argv: list[str], on_row) -> None:
    """Each shape in its own process, all started at once: their setups (model build, the
    prefill, continuation and decode compiles, graph captures; about everything but the
    timed rounds) overlap, and gpu_to_itself serialises the timed rounds. on_row(name, row)
    as each process ends; a process that ends without a row reports its exit code."""
    with tempfile.TemporaryDirectory() as sync_dir:
        sync = Path(sync_dir)
        children = {
            name: subprocess.Popen(
                [
                    *(sys.executable, __file__, *argv),
                    *("--child", name, "--sync-dir", sync_dir),
                    *("--num-children", str(len(args.shapes))),
                ]
            )
            for name in args.shapes
        }
        while children:
            for name, child in list(children.items()):
                if child.poll() is None:
                    continue
                del children[name]
                (sync / f"ready-{name}").touch()  # a crashed child must not hold the others
                row_file = sync / f"row-{name}.json"
                if row_file.exists():
                    row = json.loads(row_file.read_text())
                else:
                    row = {"shape": name, "error": f"its process exited {child.returncode}"}
                on_row(name, row)
            time.sleep(0.2)


def markdown(results: dict) -> str:
    w = results["workload"]
    lines = [
        f"# Multi-turn rollout: KV kept between turns vs the history prefilled (issue 44), "
        f"{results['device']}",
        "",
        f"commit: {results['commit']} · GPU: {results['device']} · built-in engine, "
        f"{'float32' if results['smoke'] else 'bf16'}, "
        f"{w['trajectories']} trajectories x {w['turns']} turns, prompt {w['prompt_tokens']}, "
        f"{w['response_tokens']} forced response tokens and {w['observation_tokens']}-token "
        f"observations per turn; median of {w['repeats']} rounds per mode"
        + f"; compile_scope {w.get('compile_scope', 'step')}"
        + (f"; max_prefill_tokens {w['max_prefill_tokens']}" if w.get("max_prefill_tokens") else "")
        + (" · SMOKE (tiny shape, CPU): not a measurement" if results["smoke"] else ""),
        "",
        "| shape | prefill each turn s | KV kept s | kept / prefill | bar | per turn, prefill | "
        "per turn, kept | kept sessions after each turn (kept) | setup s |",
        "|---|---:|---:|---:|---|---|---|---|---|",
    ]
    for row in results["shapes"].values():
        if "error" in row:
            lines.append(f"| {row['shape']} | {row['error'][:150]} | | | | | | | |")
            continue
        s, ratio = row["seconds"], row["ratio"]
        verdict = "PASS" if ratio <= BAR else "FAIL"
        per_turn = {m: " / ".join(f"{t:.3f}" for t in row["turn_s_median"][m]) for m in MODES}
        lines.append(
            f"| {row['shape']} | {s['prefill']:.3f} | {s['kept']:.3f} | {ratio:.3f} | "
            f"<= {BAR} {verdict} | {per_turn['prefill']} | {per_turn['kept']} | "
            f"{row['kept_sessions_after_turn']['kept']} | "
            + " / ".join(f"{k} {v:.1f}" for k, v in row.get("setup_s", {}).items())
            + " |"
        )
    profiled_rows = [row for row in results["shapes"].values() if "last_forward" in row]
    if profiled_rows:
        lines += [
            "",
            "The last turn's forward alone (--profile: one more round per mode whose last turn "
            "samples one token; its tokens prefilled whole, or continued from the kept KV), "
            "under torch.profiler: wall, kernel time and kernels by kind, ms:",
            "",
            "| shape | mode | wall | kernels | GPU waiting for the host | by kind |",
            "|---|---|---:|---:|---:|---|",
        ]
        for row in profiled_rows:
            for mode, p in row["last_forward"].items():
                groups = ", ".join(f"{g} {v:.1f}" for g, v in p["kernel_ms_by_group"].items())
                lines.append(
                    f"| {row['shape']} | {mode} | {p['wall_ms']:.1f} | {p['kernel_ms']:.1f} | "
                    f"{p['wall_ms'] - p['kernel_ms']:.1f} | {groups} |"
                )
        floors = [row for row in profiled_rows if "kept_floor" in row]
        if floors:
            lines += [
                "",
                "The lowest kept / prefilled ratio this workload allows (kept_floor: keeping the "
                "KV saves at most the prefilled forwards' extra kernel time, at the profiled "
                "prefill's rates per token and per causal query-key pair; decode and host work "
                "are the same in both modes):",
                "",
                "| shape | prefilled forwards s | kept forwards s | floor s | floor ratio | "
                "measured ratio | bar |",
                "|---|---|---|---:|---:|---:|---|",
            ]
            for row in floors:
                f = row["kept_floor"]
                reachable = "reachable" if f["floor_ratio"] <= BAR else "out of reach"
                lines.append(
                    f"| {row['shape']} | "
                    + " / ".join(f"{x:.3f}" for x in f["prefilled_forward_s"])
                    + " | "
                    + " / ".join(f"{x:.3f}" for x in f["kept_forward_s"])
                    + f" | {f['floor_s']:.3f} | {f['floor_ratio']:.3f} | {row['ratio']:.3f} | "
                    f"<= {BAR}: {reachable} |"
                )
    vllm_rows = [row for row in results["shapes"].values() if "vllm" in row]
    if vllm_rows:
        lines += [
            "",
            "yatt (KV kept) / yatt's VLLMEngine adapter over vLLM (prefix caching on), the same "
            "requests turn by turn:",
            "",
            "| shape | yatt kept s | vLLM s | yatt / vLLM | bar | per turn, vLLM |",
            "|---|---:|---:|---:|---|---|",
        ]
        for row in vllm_rows:
            ratio = row["ratio_vllm"]
            verdict = "PASS" if ratio <= VLLM_BAR else "FAIL"
            per_turn = " / ".join(f"{t:.3f}" for t in row["vllm"]["turn_s_median"])
            lines.append(
                f"| {row['shape']} | {row['seconds']['kept']:.3f} | "
                f"{row['vllm']['seconds']:.3f} | {ratio:.3f} | <= {VLLM_BAR} {verdict} | "
                f"{per_turn} |"
            )
    lines += [
        "",
        "Issue 44's second bar (rollout + judge per kept group) is bench/rollout/"
        "multiturn_judge.py's; the third (yatt / vLLM) is measured here with --vllm"
        + ("" if vllm_rows else ": not in this run")
        + ".",
        "",
        f"Command: `{results['command']}`",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=["0.5b", "1.5b"])
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU (the plumbing only)")
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=64, help="forced, per turn")
    p.add_argument("--observation-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vllm",
        action="store_true",
        help="also the same requests through yatt's VLLMEngine (prefix caching): issue 44's "
        "third bar, yatt kept / vLLM <= 1.0 (vLLM's site on the path)",
    )
    add_compile_scope_argument(p, named="the report is named _clayers")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        help="EngineConfig.max_prefill_tokens, both modes (default: the engine's): padded tokens "
        "per prefill or continuation forward",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the timed rounds, one more round per mode whose last turn samples one "
        "token, under torch.profiler: the continuation's forward against the prefill's",
    )
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="measure the shapes one after another in this process (default on GPU: one "
        "process per shape, set up side by side, timed one at a time)",
    )
    # Internal: a shape's own process (measure_in_children).
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sync-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--num-children", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.shapes = ["tiny"]
        for name, small in (("trajectories", 4), ("prompt_tokens", 16), ("response_tokens", 4)):
            setattr(args, name, min(getattr(args, name), small))
        args.observation_tokens = min(args.observation_tokens, 32)
        args.repeats = min(args.repeats, 1)
    for name in ("trajectories", "turns", "prompt_tokens", "response_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.turns < 2:
        p.error(f"--turns {args.turns}: must be >= 2 (a single turn has no history to keep)")
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA device: run with --smoke on CPU")
    if args.vllm and args.smoke:
        p.error("--vllm needs a GPU and vLLM: not with --smoke")
    if args.vllm and importlib.util.find_spec("vllm") is None:
        p.error("--vllm: vLLM is not importable (unpack its site: bench/rollout/engines_gpu.sh)")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.smoke:
        torch.set_num_threads(1)
    if args.child is not None:  # one shape's process: its row to the sync directory
        try:
            row = measure_shape(args.child, args)
        except Exception as exc:
            row = {"shape": args.child, "error": f"{type(exc).__name__}: {exc}"[:1000]}
        (Path(args.sync_dir) / f"row-{args.child}.json").write_text(json.dumps(row))
        return
    device = device_name()
    md = (
        Path(args.out_dir)
        / f"multiturn_kv_{device}{'_smoke' if args.smoke else ''}{scope_mark(args.compile_scope)}.md"
    )
    results = {
        "commit": measured_commit(["bench", "packages"]),
        "device": device,
        "smoke": args.smoke,
        "workload": {
            k: getattr(args, k)
            for k in (
                *("trajectories", "turns", "prompt_tokens", "response_tokens"),
                *("observation_tokens", "repeats", "seed", "compile_scope", "max_prefill_tokens"),
            )
        },
        "bar": BAR,
        "command": "python3 bench/rollout/multiturn_kv.py " + " ".join(argv),
        "shapes": {},
    }

    def on_row(name: str, row: dict) -> None:
        results["shapes"][name] = row
        write_report(md, markdown(results), data=results)
        summary = {k: row[k] for k in ("seconds", "ratio") if k in row} or row
        print(f"=== {name} {summary}", flush=True)

    if args.in_process or len(args.shapes) == 1:
        for name in args.shapes:
            print(f"=== {name}", flush=True)
            try:
                row = measure_shape(name, args)
            except Exception as exc:  # the next shape still runs; the error is in the report
                row = {"shape": name, "error": f"{type(exc).__name__}: {exc}"[:1000]}
            on_row(name, row)
    else:
        print(f"=== {', '.join(args.shapes)}: one process each", flush=True)
        measure_in_children(args, argv, on_row)
    print(f"wrote {md}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
