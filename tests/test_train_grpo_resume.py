"""The trainer's checkpoint `extra` on the CPU, through the real yatt.ckpt Checkpointer: a run
resumed from step k's checkpoint starts step k + 1 as the uninterrupted run would (the loader's
position, the sampler's keep rate, the cut groups held for rollout.keep_partial), and a
checkpoint written before the sampler and the cut groups were kept still resumes.

The steps themselves are not run (a streamed trainer run takes minutes on a shared CPU): the
held groups are hand-built, and step k + 1's resumption is observed where the loop makes it,
genrm.JudgedStream.resume, with a recording engine."""

NUM_GPUS = 0

import asyncio
import dataclasses
import json
import logging
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import train_grpo
from grpo_config import read_config
from grpo_prompts import Prompt

from yatt import core, genrm, rollout
from yatt.ckpt import Checkpointer

K = 3  # the checkpointed step
MAX_NEW_TOKENS = 6


class _Encoder:
    """PromptEncoder's encode(): a row's ids are its prompt's characters (a stand-in tokenizer)."""

    def __init__(self, *, offset: int = 0) -> None:
        self.offset = offset  # another "tokenizer": other ids for the same row

    def encode(self, rows, *, should_count: bool = True) -> list[Prompt]:
        return [Prompt(dict(row), [ord(c) + self.offset for c in row["prompt"]]) for row in rows]


class _RecordingEngine:
    """Records the requests a stream makes and answers none (the step is cut right after)."""

    def __init__(self) -> None:
        self.requests: list[rollout.Request] = []

    def stream(self, requests, sampling):
        self.requests.extend(requests)

        async def nothing():
            return
            yield

        return nothing()

    def abort(self) -> None:
        pass


class _Judge:
    async def ascore(self, samples):
        return [genrm.Verdict(sample_id="s", reward=0.0, status="ok") for _ in samples]


def _loader(data: Path) -> core.ShardedLoader:
    # in file order, so the rows drawn are q0, q1, ... (by hand below)
    kwargs = dict(batch_size=2, rank=0, world_size=1, prompt_key="prompt", should_shuffle=False)
    return core.ShardedLoader(data, **kwargs)


def _sampler() -> core.DynamicSampler:
    return core.DynamicSampler(target_groups=2, oversample=2.0, max_oversample=4.0, mode="stream")


def _partials(encoder=None, loader=None) -> core.PartialRollouts:
    return core.held_cut_groups("token_tis", encoder or _Encoder(), loader)


def _sample(prompt: Prompt, response, logprobs, reason) -> core.PartialSample:
    return core.PartialSample(
        prompt_ids=prompt.ids, response_ids=response, logprobs=logprobs, finish_reason=reason
    )


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _run_to_step_k(data: Path):
    """An uninterrupted run at the end of step K: rows drawn, one step's keep rate (2 of 3
    groups had reward variance), and three cut groups held (one first sampled at K - 1)."""
    loader, sampler, partials, encoder = _loader(data), _sampler(), _partials(), _Encoder()
    a, b, c = encoder.encode(loader.next_batch(3))
    sampler.num_to_draw()
    rewards = [[0.0, 1.0], [1.0, 1.0], [0.0, 0.5]]
    rows = [
        {"input_ids": [1], "group_id": g, "reward": r}
        for g, pair in enumerate(rewards)
        for r in pair
    ]
    sampler.add(core.Batch.from_samples(rows))
    sampler.take()
    partials.put(
        core.PartialGroup(
            samples=[
                _sample(a, [5, 6], [-0.125, -1.5], "abort"),
                _sample(a, [9], [-0.5], "stop"),
            ],
            step=K,
            prompt=a,
        )
    )
    partials.put(  # resumed at K and cut again: too old for K + 1, dropped and counted
        core.PartialGroup(samples=[_sample(b, [4], [-2.0], "abort")], step=K - 1, prompt=b)
    )
    partials.put(
        core.PartialGroup(
            samples=[_sample(c, [], [], "abort"), _sample(c, [1, 2], [-0.25, -0.75], "length")],
            step=K,
            prompt=c,
        )
    )
    return loader, sampler, partials


CFG = read_config([])[0]  # the resolved config a checkpoint keeps


def _track(ckpt, loader, sampler, partials, cfg) -> None:
    """What the trainer tracks: its loader, sampler, cut groups and config (its watched fields)."""
    core.track_run_state(
        ckpt,
        loader=loader,
        sampler=sampler,
        partials=partials,
        config=dataclasses.asdict(cfg),
        watched=train_grpo.RESUME_CHECKED_FIELDS,
    )


def _save(root: Path, step: int, loader, sampler, partials) -> None:
    """A checkpoint of step `step`, as the trainer writes it: the tracked objects beside it."""
    with Checkpointer(root, async_save=False) as ckpt:
        _track(ckpt, loader, sampler, partials, CFG)
        ckpt.save(step, {"model": torch.nn.Linear(2, 2)}, extra={"step": step})


def _resume(root: Path, loader, sampler, partials) -> core.Resumed:
    """A fresh process's resume: the objects tracked, then the newest checkpoint loaded."""
    with Checkpointer(root, async_save=False) as ckpt:
        _track(ckpt, loader, sampler, partials, CFG)
        return core.resume_run(ckpt, {"model": torch.nn.Linear(2, 2)}, partials=partials)


def _load_extra(root: Path):
    with Checkpointer(root, async_save=False) as ckpt:
        return ckpt.load({"model": torch.nn.Linear(2, 2)})


def _step_after(partials: core.PartialRollouts, sampler: core.DynamicSampler, step: int):
    """What step `step` starts with: the requests resuming the held groups, the finished
    samples judged as they were, the dropped count, the draw's oversampling factor."""
    engine = _RecordingEngine()
    stream = genrm.JudgedStream(
        engine=engine,
        scorer=_Judge(),
        to_request=lambda p: p.request(),
        to_sample=lambda p, c: genrm.Sample(prompt=p.row["prompt"], response="r"),
        sampling=rollout.SamplingParams(n=2, max_new_tokens=MAX_NEW_TOKENS, seed=1),
        step=step,
    )

    async def resume():
        stream.resume(partials.take(step))
        await asyncio.sleep(0)
        await stream.cut()

    asyncio.run(resume())
    requests = [(r.prompt_ids, r.max_new_tokens, r.metadata["sample"]) for r in engine.requests]
    groups = {
        key: (g.payload.row, g.first_step, sorted(g.parts)) for key, g in stream.groups.items()
    }
    resumed_logprobs = {
        key: {j: s.logprobs for j, s in g.parts.items()} for key, g in stream.groups.items()
    }
    finished = {
        key: {j: (c.response_ids, c.logprobs, c.finish_reason) for j, c in g.completions.items()}
        for key, g in stream.groups.items()
    }
    return {
        "requests": requests,
        "groups": groups,
        "resumed_logprobs": resumed_logprobs,
        "finished": finished,
        "num_dropped_stale": partials.num_dropped_stale,
        "oversample_factor": sampler.oversample_factor,
    }


def _assert_logged_dropped(out_dir: Path, restored, num_dropped: int) -> None:
    """The first step after the resume logs the count in metrics.jsonl, as the loop does."""
    run_log = core.RunLog(out_dir, is_writer=True, resume_step=restored.start_step)
    try:
        run_log.log(restored.start_step, {"reward/mean": 0.5} | restored.metrics(None))
    finally:
        run_log.close()
    (line,) = (out_dir / "metrics.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["step"] == K + 1
    assert record["dynamic_sampling/num_partial_groups_dropped_on_resume"] == num_dropped


def test_a_resumed_run_starts_step_k_plus_1_with_the_uninterrupted_runs_cut_groups(tmp_path, data):
    loader, sampler, partials = _run_to_step_k(data)
    _save(tmp_path / "ckpt", K, loader, sampler, partials)
    uninterrupted = _step_after(partials, sampler, K + 1)
    next_rows = loader.next_batch(2)

    # a fresh process: new objects, the checkpoint read back from disk
    loader2, sampler2 = _loader(data), _sampler()
    partials2 = _partials(loader=loader2)
    restored = _resume(tmp_path / "ckpt", loader2, sampler2, partials2)
    assert restored == core.Resumed(start_step=K + 1, num_partial_groups_dropped=0)
    resumed = _step_after(partials2, sampler2, restored.start_step)
    assert resumed == uninterrupted
    assert (
        [row["prompt"] for row in loader2.next_batch(2)]
        == ["q3", "q4"]
        == [row["prompt"] for row in next_rows]
    )

    # and what that is, by hand: the two step-K groups (K + 1 - (K - 1) > 1 drops the other)
    q0, q2 = [ord("q"), ord("0")], [ord("q"), ord("2")]
    rows = [g[0]["prompt"] for g in resumed["groups"].values()]
    assert sorted(rows) == ["q0", "q2"] and resumed["num_dropped_stale"] == 1
    assert sorted(resumed["requests"]) == [([*q0, 5, 6], MAX_NEW_TOKENS - 2, 0), (q2, 6, 0)]
    logprobs = sorted(map(str, resumed["resumed_logprobs"].values()))
    assert logprobs == ["{0: ()}", "{0: (-0.125, -1.5)}"]
    finished = sorted(map(str, resumed["finished"].values()))
    assert finished == ["{1: ([1, 2], [-0.25, -0.75], 'length')}", "{1: ([9], [-0.5], 'stop')}"]
    assert resumed["oversample_factor"] == pytest.approx(1.5)  # 1 / (2 of 3 groups kept)


def test_a_checkpoint_written_before_the_cut_groups_were_kept_still_resumes(tmp_path, data):
    loader, _, _ = _run_to_step_k(data)
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:  # the old extra, by hand
        extra = {"step": K, "loader": loader.state_dict()}
        ckpt.save(K, {"model": torch.nn.Linear(2, 2)}, extra=extra)
    next_rows = loader.next_batch(2)

    loader2, sampler2 = _loader(data), _sampler()
    partials2 = _partials(loader=loader2)
    restored = _resume(tmp_path / "ckpt", loader2, sampler2, partials2)
    assert restored == core.Resumed(start_step=K + 1, num_partial_groups_dropped=0)
    assert loader2.next_batch(2) == next_rows
    assert len(partials2) == 0 and partials2.num_dropped_stale == 0  # no cut groups
    assert sampler2.last_keep_rate is None and sampler2.oversample_factor == 2.0  # the prior


def test_groups_whose_prompt_cannot_be_rebuilt_are_dropped_and_logged(tmp_path, data, caplog):
    loader, sampler, partials = _run_to_step_k(data)
    held = partials.take(K)  # all three
    image_row = Prompt({"prompt": "q1", "image": b"\x89PNG"}, held[1].prompt.ids)  # not JSON
    held[1].prompt = image_row
    for group in held:
        partials.put(group)
    _save(tmp_path / "ckpt", K, loader, sampler, partials)

    loader2 = _loader(data)
    partials2 = _partials(loader=loader2)
    with caplog.at_level(logging.WARNING, logger="train_grpo"):
        restored = _resume(tmp_path / "ckpt", loader2, _sampler(), partials2)
    assert [g.prompt.row["prompt"] for g in partials2.take(K)] == ["q0", "q2"]
    assert "1 of the checkpoint's cut groups are not resumed" in caplog.text
    assert restored.num_partial_groups_dropped == 1  # the image row's group
    _assert_logged_dropped(tmp_path / "run", restored, 1)

    # another tokenizer: the saved responses continue ids the rows no longer give
    loader3 = _loader(data)
    partials3 = _partials(_Encoder(offset=1), loader3)
    restored = _resume(tmp_path / "ckpt", loader3, _sampler(), partials3)
    assert len(partials3) == 0 and restored.num_partial_groups_dropped == 3


def test_cut_groups_in_a_checkpoint_are_ignored_when_keep_partial_is_off_now(
    tmp_path, data, caplog
):
    loader, sampler, partials = _run_to_step_k(data)
    _save(tmp_path / "ckpt", K, loader, sampler, partials)
    sampler2 = _sampler()
    with caplog.at_level(logging.WARNING, logger="train_grpo"):
        restored = _resume(tmp_path / "ckpt", _loader(data), sampler2, None)
    assert restored == core.Resumed(start_step=K + 1, num_partial_groups_dropped=3)
    assert sampler2.last_keep_rate == pytest.approx(2 / 3)
    assert "holds 3 cut groups; rollout.keep_partial is off" in caplog.text


class _ImageEncoder:
    """encode() of rows with an opened image: the prompt's characters, then the image's first
    pixel (a stand-in for image tokens: other pixels, other ids)."""

    def encode(self, rows, *, should_count: bool = True) -> list[Prompt]:
        return [
            Prompt(
                dict(row),
                [ord(c) for c in row["prompt"]] + list(row["image"].getpixel((0, 0))),
                images=[row["image"]],
            )
            for row in rows
        ]


def test_groups_of_rows_with_images_are_kept_by_row_index_and_read_again(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    colors = ["red", "green", "blue", "white"]
    for i, color in enumerate(colors):
        Image.new("RGB", (3, 2), color).save(tmp_path / f"q{i}.png")
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"q{i}", "answer": str(i), "image": f"q{i}.png"} for i in range(4)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))

    def image_loader():
        kwargs = dict(batch_size=2, prompt_key="prompt", image_key="image", should_shuffle=False)
        return core.ShardedLoader(path, **kwargs)

    loader, encoder = image_loader(), _ImageEncoder()
    partials = _partials(encoder, loader)
    q0, q1 = encoder.encode(loader.next_batch(2))
    for prompt in (q0, q1):
        sample = _sample(prompt, [5, 6], [-0.125, -1.5], "abort")
        partials.put(core.PartialGroup(samples=[sample], step=K, prompt=prompt))
    _save(tmp_path / "ckpt", K, loader, _sampler(), partials)
    saved = [g["prompt"] for g in _load_extra(tmp_path / "ckpt")["partials"]["groups"]]
    assert saved == [{"row_index": 0, "ids": q0.ids}, {"row_index": 1, "ids": q1.ids}]

    # q1's image changed on disk since: its saved responses continue other ids, dropped
    Image.new("RGB", (3, 2), "black").save(tmp_path / "q1.png")
    loader2 = image_loader()
    partials2 = _partials(encoder, loader2)
    restored = _resume(tmp_path / "ckpt", loader2, _sampler(), partials2)
    assert restored == core.Resumed(start_step=K + 1, num_partial_groups_dropped=1)
    (group,) = partials2.take(K + 1)
    assert group.prompt.row["prompt"] == "q0" and group.prompt.ids == q0.ids
    assert group.prompt.images[0].getpixel((0, 0)) == (255, 0, 0)  # read again: red
    assert [list(s.response_ids) for s in group.samples] == [[5, 6]]


def test_a_resume_that_changes_the_objective_warns_once_and_says_so_in_its_metrics(
    tmp_path, data, caplog
):
    from dataclasses import replace

    loader, sampler, partials = _run_to_step_k(data)
    _save(tmp_path / "ckpt", K, loader, sampler, partials)
    saved = _load_extra(tmp_path / "ckpt")["config"]  # the resolved config, with the step
    assert saved["loss"]["objective"] == CFG.loss.objective == "dapo"
    changed = replace(CFG, loss=replace(CFG.loss, objective="gspo"))
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        _track(ckpt, _loader(data), _sampler(), None, changed)
        with caplog.at_level(logging.WARNING):
            restored = core.resume_run(ckpt, {"model": torch.nn.Linear(2, 2)}, partials=None)
    assert restored.changed == ("loss.objective",)
    assert caplog.text.count("'dapo' -> 'gspo'") == 1
    assert restored.metrics(None)["resume/changed/loss.objective"] == 1.0
    # the same config: nothing changed, nothing said
    loader2 = _loader(data)
    restored = _resume(tmp_path / "ckpt", loader2, _sampler(), _partials(loader=loader2))
    assert restored.changed == () and not any(
        key.startswith("resume/changed/") for key in restored.metrics(None)
    )
