"""The embedded default task: single-digit addition, a tiny policy and a tiny generative judge.

Everything is built locally in a setup step (no downloads) and cached under a work directory:

    prompts.jsonl   {"prompt": "3+4=", "answer": "7"} rows, the training split
    eval.jsonl      held-out rows: the sums of a digit with itself (2+2=), never in prompts.jsonl
    policy/         a tiny causal LM fine-tuned on *noisy* answers (right ~25% of the time), so
                    GRPO has something to improve and a signal to find
    judge/          a tiny causal LM fitted to say "Yes"/"No" after the GenRM's own verification
                    prompt, on the task's right and wrong answers: a generative judge whose
                    verdicts carry signal (a random-weight judge would only add noise)

Both models are byte-level (yatt.testing.make_tokenizer), so `prompt` and the answer text map
one byte per token.
"""

from __future__ import annotations

import fcntl
import json
import logging
import random
from collections.abc import Callable
from pathlib import Path

import torch
from grpo_data import judge_sample
from transformers import AutoModelForCausalLM, AutoTokenizer

from yatt.genrm import JudgeTemplate
from yatt.testing import make_tiny_causal_lm, make_tokenizer

logger = logging.getLogger("train_grpo")
MAX_DIGIT = 4
_READY = "READY"
NUM_EVAL_ROWS = 64


def is_prepared(workdir: Path) -> bool:
    """Built and complete (READY is written last; eval.jsonl is checked too: older builds
    lacked it and are rebuilt)."""
    return (workdir / _READY).exists() and (workdir / "eval.jsonl").exists()


def is_held_out(a: int, b: int) -> bool:
    """The eval split's pairs: RL never trains on them (the base policy's fit saw every pair)."""
    return a == b


def addition_rows(num_rows: int, seed: int, *, is_eval: bool = False) -> list[dict[str, str]]:
    """Rows of the training split, or of the held-out eval split."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < num_rows:
        a, b = rng.randint(0, MAX_DIGIT), rng.randint(0, MAX_DIGIT)
        if is_held_out(a, b) == is_eval:
            rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def write_rows(path: Path, rows: list[dict[str, str]]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def is_correct(prompt: str, response: str) -> bool:
    a, b = prompt.rstrip("=").split("+")
    return response.strip() == str(int(a) + int(b))


def _fit_completions(
    model_dir: Path,
    pairs: Callable[[random.Random], tuple[str, str]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> float:
    """Teacher-force `completion + eos` after `prompt`; loss on the completion only."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # Cosine decay: tiny models at a high rate learn fast, then need a low rate to settle.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=lr / 20)
    loss_value = float("nan")
    for step in range(steps):
        rows_ids, rows_labels = [], []
        for _ in range(batch_size):
            prompt, completion = pairs(rng)
            p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [
                tokenizer.eos_token_id
            ]
            rows_ids.append(p + c)
            rows_labels.append([-100] * len(p) + c)
        width = max(len(r) for r in rows_ids)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for i, (r, lab) in enumerate(zip(rows_ids, rows_labels, strict=True)):
            ids[i, : len(r)] = torch.tensor(r)
            labels[i, : len(lab)] = torch.tensor(lab)
            mask[i, : len(r)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_value = loss.item()
        if step % 100 == 0:
            logger.info(
                "fitting the embedded %s: step %d/%d, loss %.3f",
                model_dir.name,
                step,
                steps,
                loss_value,
            )
    model.eval()
    model.save_pretrained(model_dir)
    return loss_value


def build_policy(model_dir: Path, *, seed: int, p_correct: float = 0.25, steps: int = 300) -> None:
    """A "base model" that knows the answer format but is right only about p_correct of the time."""
    make_tiny_causal_lm(model_dir, arch="qwen2", hidden_size=64, num_layers=2, seed=seed)

    def pairs(rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, MAX_DIGIT), rng.randint(0, MAX_DIGIT)
        answer = a + b if rng.random() < p_correct else rng.randint(0, 2 * MAX_DIGIT)
        return f"{a}+{b}=", str(answer)

    _fit_completions(model_dir, pairs, steps=steps, batch_size=64, lr=3e-3, seed=seed)


def _garbage(rng: random.Random, answer: str) -> str:
    pieces = [answer, str(rng.randint(0, 9)), " ", "ref", " ref ", "+", "=", "\n"]
    while True:
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 3)))
        if text != answer:
            return text


def draw_addition(rng: random.Random) -> tuple[str, str, list[str]]:
    """(prompt, right answer, wrong answers) of one addition, for fitting the judge."""
    a, b = rng.randint(0, MAX_DIGIT), rng.randint(0, MAX_DIGIT)
    return f"{a}+{b}=", str(a + b), [str(x) for x in range(2 * MAX_DIGIT + 1) if x != a + b]


def build_judge(
    model_dir: Path,
    render: Callable[[str, str, str], str],
    *,
    seed: int,
    steps: int = 800,
    draw: Callable[[random.Random], tuple[str, str, list[str]]] = draw_addition,
) -> None:
    """A judge that answers the GenRM's own verification prompt with "Yes" or "No".

    `render(prompt, response, reference)` is the exact judge prompt the GenRM will send (its
    template and chat formatting), so the judge is fitted on what it will read at scoring time.
    With the reference answer in its prompt the judge learns to compare, not to solve: a skill
    a tiny model picks up in seconds and that transfers to every prompt. `draw(rng)` gives a
    task's (prompt, right answer, wrong answers) (tiny_vision_task.py passes its own).
    """
    make_tiny_causal_lm(model_dir, arch="qwen2", hidden_size=96, num_layers=3, seed=seed + 1)
    # A judge tokenizer without a chat template: the GenRM then sends its plain template text,
    # which keeps the tiny judge's prompts short (about a dozen tokens).
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.pop("chat_template", None)
    config_path.write_text(json.dumps(tokenizer_config, indent=2))

    def pairs(rng: random.Random) -> tuple[str, str]:
        prompt, answer, wrong = draw(rng)
        kind = rng.random()
        if kind < 0.5:
            response = answer
        elif kind < 0.75:
            response = rng.choice(wrong)
        else:
            # Off-format text, including copies of the judge's own prompt: without these a
            # policy soon finds responses (e.g. "7 ref 7") that fool a judge fitted on digits.
            response = _garbage(rng, answer)
        return render(prompt, response, answer), "Yes" if response == answer else "No"

    _fit_completions(model_dir, pairs, steps=steps, batch_size=64, lr=3e-3, seed=seed + 1)


def prepare(
    workdir: str | Path,
    render: Callable[[str, str, str], str] | None,
    *,
    seed: int = 0,
    num_rows: int = 2048,
) -> dict[str, Path]:
    """Build (or reuse) the dataset, the base policy and the judge under `workdir`."""
    workdir = Path(workdir)
    paths = {
        "prompts": workdir / "prompts.jsonl",
        "eval": workdir / "eval.jsonl",
        "policy": workdir / "policy",
        "judge": workdir / "judge",
    }
    if is_prepared(workdir):
        return paths
    if render is None:
        raise RuntimeError(f"{workdir} is not prepared and no judge prompt renderer was given")
    workdir.mkdir(parents=True, exist_ok=True)
    write_rows(paths["prompts"], addition_rows(num_rows, seed))
    write_rows(paths["eval"], addition_rows(NUM_EVAL_ROWS, seed + 1, is_eval=True))
    build_policy(paths["policy"], seed=seed)
    build_judge(paths["judge"], render, seed=seed)
    # Written last: an interrupted setup is redone rather than half-reused.
    (workdir / _READY).write_text("ok\n")
    return paths


def prepare_locked(workdir: Path, template: JudgeTemplate) -> dict[str, Path]:
    """`prepare(workdir, ...)` under a file lock: the first process (of any rank) builds the
    task while the others wait, then they reuse it. No process group is needed, so the trainer
    builds it before its runtime starts."""
    return locked_build(workdir, template, prepare)


def locked_build(
    workdir: Path,
    template: JudgeTemplate,
    prepare_fn: Callable[[Path, Callable[[str, str, str], str]], dict[str, Path]],
) -> dict[str, Path]:
    """`prepare_fn(workdir, render)` under workdir/.lock. The judge is fitted on prompts
    rendered exactly as the trainer renders them (its judge_sample, through the GenRM's
    template): `render(prompt, response, reference)`."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = None  # as the judge's saved tokenizer (see build_judge)

    def render(prompt: str, response: str, reference: str) -> str:
        row = {"prompt": prompt, "answer": reference}
        sample = judge_sample(row, response, prompt_key="prompt", answer_key="answer")
        ids, _ = template.render_ids(sample, tokenizer)
        return tokenizer.decode(ids)

    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return prepare_fn(workdir, render)
