"""What every layout of bench/step/step.py (and bench/step/step_trl.py) shares: models, prompts, forced
response lengths, the judge, and the GPU sampler. One definition, so the layouts cannot drift.

Text: the byte-level tokenizer of yatt.testing sits beside both random-weight models (one token
per ASCII letter), so a prompt of 128 random letters is exactly 128 tokens, and a response's
token ids are shown to the judge as one letter per token (`ids_to_text`): the judge's prompt
length then follows the response length exactly (about 300 to 1300 tokens here).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from compile_scope import SCOPES, scope_mark
from device_label import device_name  # noqa: F401  (setup.device_name for bench/lora)

# Qwen2.5-0.5B's and -1.5B's shapes (random weights; --shape, --judge-shape); --tiny: a 2-layer
# model (both roles). max_position_embeddings is cut to what the runs use (the RoPE table).
QWEN25_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_theta=1e6,
    max_position_embeddings=4096,
)
# Qwen/Qwen2.5-1.5B's config.json: 1536 wide, 28 layers, 12 query and 2 KV heads (head 128),
# MLP 8960, tied embeddings (about 1.54B parameters, 0.23B of them the embedding).
QWEN25_15B = dict(
    QWEN25_05B,
    hidden_size=1536,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    intermediate_size=8960,
)
# Qwen/Qwen2.5-3B's config.json: 2048 wide, 36 layers, 16 query and 2 KV heads (head 128), MLP
# 11008, tied embeddings (about 3.09B parameters).
QWEN25_3B = dict(
    QWEN25_05B,
    hidden_size=2048,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    intermediate_size=11008,
)
# Qwen/Qwen2.5-7B's config.json: 3584 wide, 28 layers, 28 query and 4 KV heads (head 128), MLP
# 18944, a 152064-row vocabulary and an untied head (about 7.62B parameters).
QWEN25_7B = dict(
    QWEN25_05B,
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
    tie_word_embeddings=False,
)
# Qwen2.5-14B's and -32B's config.json shapes: 5120 wide, 40 query and 8 KV heads; 48 layers and
# MLP 13824 (14B), 64 layers and MLP 27648 (32B). Used by bench/lora/lora_gpu.py.
QWEN25_14B = dict(
    QWEN25_7B,
    hidden_size=5120,
    num_hidden_layers=48,
    num_attention_heads=40,
    num_key_value_heads=8,
    intermediate_size=13824,
)
QWEN25_32B = dict(QWEN25_14B, num_hidden_layers=64, intermediate_size=27648)
SHAPES = {
    "0.5b": QWEN25_05B,
    "1.5b": QWEN25_15B,
    "3b": QWEN25_3B,
    "7b": QWEN25_7B,
    "14b": QWEN25_14B,
    "32b": QWEN25_32B,
}
TINY = dict(QWEN25_05B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
TINY["intermediate_size"] = 128
TINY["vocab_size"] = 512


def shape_names(args: Any) -> tuple[str, str]:
    """(policy, judge) shape names of a run: --shape, --judge-shape (default: --shape); "tiny"
    for both with --tiny."""
    if getattr(args, "tiny", False):
        return "tiny", "tiny"
    policy = getattr(args, "shape", None) or "0.5b"
    return policy, getattr(args, "judge_shape", None) or policy


def shape_config(name: str) -> dict:
    return TINY if name == "tiny" else SHAPES[name]


def count_parameters(name: str) -> int:
    """Parameters of shape `name` (tied embeddings counted once), built on the meta device:
    nothing allocated."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape_config(name)))
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once


JUDGE_USER = (
    "Question:\n{prompt}\n\nResponse:\n{response}\n\n"
    "Is the response's final answer correct? Reply with one word: Yes or No."
)
JUDGE_TEMPLATE_TOKENS = 160  # chat template + the text above, rounded up (engine context)

# The seed mix's defaults: half the groups without reward variance, a 1.5B judge
# writing a 384-token chain of thought (the middle of the seed's 256-512) before its verdict.
SEED_NO_VARIANCE_SHARE = 0.5
SEED_JUDGE_TOKENS = 384
SEED_JUDGE_SHAPE = "1.5b"


@dataclass(kw_only=True, frozen=True)
class Workload:
    """The same for every layout: prompts, groups, lengths, judge verdict length."""

    num_prompts: int = 16  # GRPO groups per step, over all GPUs
    group_size: int = 8  # completions per prompt
    prompt_tokens: int = 128
    judge_tokens: int = 8  # verdict tokens, forced (ignore_eos) so every run judges the same
    seed: int = 0
    # The seed mix: the share of drawn groups whose hidden labels are all equal (no reward
    # variance: dynamic sampling drops them).
    no_variance_share: float = SEED_NO_VARIANCE_SHARE

    @property
    def num_samples(self) -> int:
        return self.num_prompts * self.group_size


def workload(args: Any, num_gpus: int = 1) -> Workload:
    """The GPU workload, or a smaller batch (same lengths) for --tiny CPU runs.

    --prompts N: N GRPO groups per step over all GPUs. --prompts-per-rank N: N per GPU of the
    run, judge GPUs included (`num_gpus`), so every layout on as many GPUs does the same work
    (8 GPUs: 8N prompts, whether 8 colocated ranks or 6 policy ranks and 2 judge GPUs)."""
    tiny = getattr(args, "tiny", False)
    default = 4 if tiny else Workload.num_prompts
    num_prompts = getattr(args, "prompts", None) or default
    if getattr(args, "prompts_per_rank", None):
        num_prompts = args.prompts_per_rank * num_gpus
    group_size = 4 if tiny else Workload.group_size
    share = getattr(args, "no_variance_share", None)
    return Workload(
        num_prompts=num_prompts,
        group_size=group_size,
        judge_tokens=args.judge_tokens,
        no_variance_share=SEED_NO_VARIANCE_SHARE if share is None else share,
    )


def prompt_range(num_prompts: int, num_ranks: int, rank: int) -> range:
    """The prompts of DP rank `rank`: contiguous, sizes differing by at most one (6 policy ranks
    share 512 prompts as 85, 85, 86, 85, 85, 86; the train phase's balancing evens the rest)."""
    return range(rank * num_prompts // num_ranks, (rank + 1) * num_prompts // num_ranks)


# -- length mixes ------------------------------------------------------------------------------
MIXES = ("fixed", "longtail", "seed")
MAX_RESPONSE_TOKENS = 1024


def response_lengths(mix: str, work: Workload, step: int) -> list[int]:
    """Forced response length of every sample of step `step` (prompt-major, group-minor).

    fixed:    every response 256 tokens (the TRL comparison).
    longtail: 90% uniform in [64, 192] (median about 128), 10% uniform in [512, 1024], i.e.
              4-8x the median; drawn per sample (lengths differ inside a group), seeded by
              (seed, step), so every layout and GPU count sees the same lengths.
    seed:     dynamic sampling draws its groups one by one (seed_group); this is the lengths
              of the first num_prompts of them on one rank, for a look at the distribution.
    """
    if mix == "fixed":
        return [256] * work.num_samples
    if mix == "seed":
        groups = [seed_group(work, step, 0, k) for k in range(work.num_prompts)]
        return [n for g in groups for n in g.lengths]
    if mix != "longtail":
        raise ValueError(f"mix={mix!r}: use one of {MIXES}")
    rng = np.random.default_rng([work.seed, step, 1])
    return _longtail_lengths(rng, work.num_samples)


def _longtail_lengths(rng: np.random.Generator, count: int) -> list[int]:
    is_long = rng.random(count) < 0.10
    short = rng.integers(64, 193, count)
    long = rng.integers(512, MAX_RESPONSE_TOKENS + 1, count)
    return [int(v) for v in np.where(is_long, long, short)]


@dataclass(frozen=True)
class SeedGroup:
    """One GRPO group of the seed mix: a prompt, each sample's forced length, and each
    sample's hidden label (1: the judge's verdict counts as correct, 0: as wrong)."""

    key: int  # unique in the run: (step, rank, draw index) folded into one int
    text: str
    lengths: tuple[int, ...]
    labels: tuple[int, ...]

    @property
    def has_variance(self) -> bool:
        return len(set(self.labels)) > 1


def seed_group(work: Workload, step: int, rank: int, index: int) -> SeedGroup:
    """The `index`-th group rank `rank` draws in step `step` of the seed mix, the same in every
    layout and sampler (seeded by all four), so every run sees the same pattern in the same
    order: with probability work.no_variance_share all its labels are equal (0 or 1, even
    odds: the group has no reward variance), else they are drawn per sample with at least one
    of each; lengths are the longtail mix's, per sample."""
    rng = np.random.default_rng([work.seed, step, rank, index, 26])
    letters = rng.integers(0, 26, work.prompt_tokens)
    lengths = _longtail_lengths(rng, work.group_size)
    if rng.random() < work.no_variance_share:
        labels = [int(rng.integers(0, 2))] * work.group_size
    else:
        labels = [int(v) for v in rng.integers(0, 2, work.group_size)]
        if len(set(labels)) == 1:  # a group with variance has both verdicts
            labels[int(rng.integers(0, work.group_size))] ^= 1
    key = ((step * 1024 + rank) << 20) + index
    return SeedGroup(
        key=key,
        text="".join(chr(97 + int(c)) for c in letters),
        lengths=tuple(lengths),
        labels=tuple(labels),
    )


def prompt_texts(work: Workload, step: int) -> list[str]:
    """`num_prompts` strings of `prompt_tokens` random lowercase letters (1 token each)."""
    rng = np.random.default_rng([work.seed, step, 0])
    letters = rng.integers(0, 26, (work.num_prompts, work.prompt_tokens))
    return ["".join(chr(97 + int(c)) for c in row) for row in letters]


def ids_to_text(ids: list[int]) -> str:
    """A response as the judge reads it: one letter per token (random ids have no text)."""
    return "".join(chr(97 + t % 26) for t in ids)


# -- models ------------------------------------------------------------------------------------
def make_models(
    root: Path, *, tiny: bool, shapes: tuple[str, str] = ("0.5b", "0.5b")
) -> tuple[Path, Path]:
    """(policy_dir, judge_dir): random Qwen2 weights + the byte tokenizer, saved once; made
    again when `shapes` (policy, judge: shape_names) differ from the saved ones."""
    policy_dir, judge_dir = root / "policy", root / "judge"
    marker = root / "models.json"
    if tiny:
        shapes = ("tiny", "tiny")
    configs = {"policy": shape_config(shapes[0]), "judge": shape_config(shapes[1])}
    if marker.is_file() and json.loads(marker.read_text()) == configs:
        return policy_dir, judge_dir
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from yatt.testing import make_tokenizer

    tokenizer = make_tokenizer()
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    dtype = torch.float32 if tiny else torch.bfloat16
    for seed, path, shape in ((1, policy_dir, configs["policy"]), (2, judge_dir, configs["judge"])):
        shutil.rmtree(path, ignore_errors=True)
        torch.manual_seed(seed)
        # Random init of 0.5B parameters takes ~25 s on the host, well under 1 s on a GPU.
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(Qwen2Config(**shape, **ids), dtype=dtype)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        del model
    marker.write_text(json.dumps(configs))
    return policy_dir, judge_dir


def build_judge(
    judge_dir: Path,
    *,
    device: str,
    tiny: bool,
    work: Workload,
    slots: int,
    keep_graphs=False,
    batch_window_ms: float | None = None,
    compile_scope: str = "step",
):
    """A yatt.genrm.GenRM on its own BuiltinEngine (region prefix "genrm"); batch_window_ms:
    BatchingConfig.batch_window_millis (None: its default)."""
    from yatt import genrm, rollout

    context = work.prompt_tokens + MAX_RESPONSE_TOKENS + JUDGE_TEMPLATE_TOKENS + work.judge_tokens
    engine = rollout.BuiltinEngine(
        judge_dir,
        config=rollout.EngineConfig(
            device=device,
            dtype="float32" if tiny else "bfloat16",
            max_batch_size=slots,
            max_seq_len=context,
            max_prefill_tokens=max(16384, context),
            region_prefix="genrm",
            keep_graphs_asleep=keep_graphs,
            compile_scope=compile_scope,
        ),
    )
    judge = genrm.GenRM(
        engine,
        template=genrm.JudgeTemplate(user=JUDGE_USER, max_response_tokens=2 * MAX_RESPONSE_TOKENS),
        parser=genrm.YesNoParser(),
        # Forced length: random weights never say Yes/No, so every verdict is "unparsable" and
        # gets default_reward 0 (counted, logged, never raised). The values do not matter here.
        sampling=rollout.SamplingParams(
            temperature=0.0, max_new_tokens=work.judge_tokens, ignore_eos=True
        ),
        default_reward=0.0,
        # Every batch in flight at once: they join the judge engine's running decode loop, so a
        # cap here would make late batches wait for whole earlier decodes (the long-tail end).
        batching=genrm.BatchingConfig(
            max_batch_size=slots,
            max_pending=4 * slots,
            max_inflight_batches=slots,
            **({} if batch_window_ms is None else {"batch_window_millis": batch_window_ms}),
        ),
    )
    return judge, engine


def make_rollout_engine(
    args: Any, policy_dir: Path, *, device: str, work: Workload, max_batch_size: int
):
    """The rollout engine of --rollout-backend: yatt's built-in one, or vLLM/SGLang in bf16
    taking --engine-memory of the GPU at start-up (their KV pool; a sleep frees it)."""
    from yatt import rollout

    max_seq_len = work.prompt_tokens + MAX_RESPONSE_TOKENS
    if args.rollout_backend == "vllm":
        config = rollout.VLLMConfig(
            dtype="bfloat16",
            gpu_memory_utilization=args.engine_memory,
            max_model_len=max_seq_len,
            llm_kwargs={"max_num_seqs": max_batch_size, **args.engine_kwargs},
        )
        return rollout.VLLMEngine(policy_dir, config=config)
    if args.rollout_backend == "sglang":
        config = rollout.SGLangConfig(
            dtype="bfloat16",
            mem_fraction_static=args.engine_memory,
            context_length=max_seq_len + 8,  # SGLang serves 2 positions less than its context
            engine_kwargs={"max_running_requests": max_batch_size, **args.engine_kwargs},
        )
        return rollout.SGLangEngine(policy_dir, config=config)
    return rollout.BuiltinEngine(
        policy_dir,
        config=rollout.EngineConfig(
            device=device,
            dtype="float32" if args.tiny else "bfloat16",
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            max_prefill_tokens=16384,
            region_prefix="rollout",
            keep_graphs_asleep=args.keep_graphs,
            stream_priority=-1,  # beside the judge (partial), the rollout's tail goes first
            compile_scope=getattr(args, "compile_scope", SCOPES[0]),
        ),
        # One rollout phase per step, after the weight sync that follows each wake of its
        # weights: no pinned host copy of them (15 GB at 7B) is needed. The seed mix's sampling
        # rounds wake the engine again before any sync (full colocation), so it keeps one.
        should_back_up_weights="seed" in getattr(args, "mixes", ("seed",)),
    )


def variant_key(layout: str, args: Any, num_ranks: int = 1) -> str:
    """A run's name in the results: the layout, then what differs from the defaults.

    dedicated with a pool: "-<policy GPUs>+<judge GPUs>" (dedicated-6+2; one policy rank and
    one judge GPU, the 2-GPU run, stays "dedicated"), "-s<n>" when n judge servers share
    fewer GPUs. Then "-pr<N>" (--prompts-per-rank), "-1.5b" (--shape), "-j<shape>" (a
    --judge-shape unlike the policy's), "-js<N>" (--judge-slots, colocated judges). The seed
    mix's sampler: "-old" (--sampler old), "-keep" (--keep-partial), "-nv<share>"
    (--no-variance-share), "-fill<q>" (--fill-probability); then "-jw<ms>"
    (--judge-batch-window-ms), "-clayers" (--compile-scope layers). Every name of a run (its JSON, its profile, its out-of-memory
    record) is built from this one key."""
    key = layout
    judge_gpus = getattr(args, "judge_gpus", None) or []
    if layout == "dedicated" and judge_gpus:
        num_judge_gpus = len(set(judge_gpus))
        if (num_ranks, num_judge_gpus) != (1, 1):
            key += f"-{num_ranks}+{num_judge_gpus}"
        if len(judge_gpus) != num_judge_gpus:
            key += f"-s{len(judge_gpus)}"
    if getattr(args, "rollout_backend", "builtin") != "builtin":
        key += f"-{args.rollout_backend}"
    if getattr(args, "offload", "always") != "always":
        key += f"-{args.offload}"
    if getattr(args, "prompts", None) not in (None, Workload.num_prompts):
        key += f"-p{args.prompts}"
    if getattr(args, "prompts_per_rank", None):
        key += f"-pr{args.prompts_per_rank}"
    if not getattr(args, "tiny", False):
        policy, judge = shape_names(args)
        key += f"-{policy}" if policy != "0.5b" else ""
        key += f"-j{judge}" if judge != policy else ""
    if getattr(args, "judge_slots", None) and layout != "dedicated":
        key += f"-js{args.judge_slots}"
    if getattr(args, "ckpt_when_busy", "wait") != "wait":
        key += f"-{args.ckpt_when_busy}"
    if "seed" in (getattr(args, "mixes", None) or []):  # the seed mix's sampler settings
        if getattr(args, "sampler", "new") == "old":
            key += "-old"
        if getattr(args, "keep_partial", False):
            key += "-keep"
        share = getattr(args, "no_variance_share", None)
        if share is not None and share != SEED_NO_VARIANCE_SHARE:
            key += f"-nv{share:g}"
        fill = getattr(args, "fill_probability", None)
        if fill is not None:
            key += f"-fill{fill:g}"
    window = getattr(args, "judge_batch_window_ms", None)
    if window is not None and layout in ("full", "partial"):
        key += f"-jw{window:g}"
    key += scope_mark(getattr(args, "compile_scope", SCOPES[0]), separator="-")
    return key


def close_run(ctx: Any) -> None:
    """Close what bench/step/step.py's build() made (after a failure too); drop the checkpoints."""
    for closeable in (ctx.ckpt, ctx.judge_engine, ctx.engine):
        if closeable is not None:
            with contextlib.suppress(Exception):
                closeable.close()
    for server in ctx.servers:
        server.terminate()
    for server in ctx.servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=20)
    if ctx.runtime.is_rank_zero:
        shutil.rmtree(ctx.ckpt_root, ignore_errors=True)


# -- GPU sampler -------------------------------------------------------------------------------
def physical_gpu(local_index: int) -> int:
    """NVML index of CUDA device `local_index` (CUDA_VISIBLE_DEVICES may renumber them)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return local_index
    return int(visible.split(",")[local_index])


class GpuSampler:
    """Samples NVML utilization and used memory of `gpus` every `period_s` on a thread.

    `window(t0, t1)` gives, per GPU, the mean utilization (busy fraction: the share of the last
    sample period in which a kernel ran, as NVML defines it) and the peak used memory. Without
    NVML (CPU machines) `available` is False and windows hold None.
    """

    def __init__(self, gpus: list[int], *, period_s: float = 0.02) -> None:
        self.gpus = gpus
        self.period_s = period_s
        self.samples: list[tuple[float, list[int], list[int]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in gpus]
            self.available = bool(gpus)
        except Exception:  # no pynvml or no driver: CPU runs
            self.available = False

    def start(self) -> GpuSampler:
        if self.available:
            self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        nv = self._nvml
        while not self._stop.is_set():
            util = [nv.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            used = [nv.nvmlDeviceGetMemoryInfo(h).used for h in self._handles]
            self.samples.append((time.perf_counter(), util, used))
            self._stop.wait(self.period_s)

    def window(self, t0: float, t1: float) -> list[dict[str, Any]]:
        rows = [s for s in self.samples if t0 <= s[0] <= t1]
        out = []
        for k, gpu in enumerate(self.gpus):
            if not rows:
                out.append({"gpu": gpu, "busy": None, "peak_used_gib": None})
                continue
            out.append(
                {
                    "gpu": gpu,
                    "busy": float(np.mean([r[1][k] for r in rows])) / 100.0,
                    "peak_used_gib": max(r[2][k] for r in rows) / 2**30,
                }
            )
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


# -- requests -------------------------------------------------------------------------------
def make_requests(ctx: Any, mix: str, step: int):
    """This rank's requests for `step` (one per sample, each with its forced length)."""
    from yatt import rollout

    work = ctx.work
    texts = prompt_texts(work, step)
    lengths = response_lengths(mix, work, step)
    tok = ctx.engine.tokenizer
    requests, expected, prompts = [], [], []
    # One request per sample (n=1), so lengths differ inside a GRPO group.
    for p in ctx.prompts:
        ids = tok(texts[p], add_special_tokens=False)["input_ids"]
        for j in range(work.group_size):
            length = lengths[p * work.group_size + j]
            requests.append(
                rollout.Request(prompt_ids=ids, max_new_tokens=length, metadata={"group": p})
            )
            expected.append(length)
            prompts.append(texts[p])
    sampling = rollout.SamplingParams(
        temperature=1.0, max_new_tokens=max(expected), ignore_eos=True, seed=1000 + step
    )
    return requests, sampling, expected, prompts


def default_ckpt_root(tiny: bool) -> Path:
    """RAM (/dev/shm) when it has room: the checkpoint phase then measures the blocked time of
    staging, not a disk slower than one save per step; else the temp folder."""
    shm = Path("/dev/shm")
    if not tiny and shm.is_dir() and shutil.disk_usage(shm).free > 48 * 2**30:
        return shm / "yatt-step-ckpt"
    return Path(tempfile.gettempdir()) / "yatt-step-ckpt"
