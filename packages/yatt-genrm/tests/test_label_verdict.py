NUM_GPUS = 0

# Verdicts scored from the judge's label probabilities (yatt.genrm._label_verdict). The judge's
# text is scripted (a tiny random model writes no verdicts), its probabilities are a real tiny
# model's, through the built-in engine; expected rewards come from a Hugging Face forward pass
# at the label's position: 2 * p(Y) / (p(Y) + p(N)) - 1 (the tiny tokenizer has one token per
# byte, so "Yes" and "No" first differ at "Y" / "N").

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.genrm import GenRM, Sample, ScoreParser, YesNoParser, verification_template
from yatt.genrm._label_verdict import reward_from_label_logprobs
from yatt.genrm.testing import FakeJudgeEngine
from yatt.rollout import BuiltinEngine, Completion, EngineConfig, SamplingParams
from yatt.testing import make_tiny_causal_lm

CORPUS = json.loads((Path(__file__).parent / "data" / "adversarial_verdicts.json").read_text())


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("label-judge")
    make_tiny_causal_lm(path, arch="qwen2", seed=3, max_position_embeddings=1024)
    return path


@pytest.fixture(scope="module")
def real(judge_dir):
    engine = BuiltinEngine(judge_dir, config=EngineConfig(max_batch_size=8, max_seq_len=1024))
    yield engine
    engine.close()


class ScriptedJudge:
    """Writes `script(sample_index)` as its verdict text; label probabilities (first token and
    forced steps) come from the real engine."""

    def __init__(self, real, script):
        self.real, self.script = real, script
        self.tokenizer = real.tokenizer
        self.supports_label_logprobs = True
        self.num_forced_steps = 0

    def generate(self, requests, sampling):
        if sampling.max_new_tokens == 1 and sampling.label_token_ids:
            self.num_forced_steps += len(requests)
            return self.real.generate(requests, sampling)
        first = self.real.generate(
            requests, SamplingParams(max_new_tokens=1, label_token_ids=sampling.label_token_ids)
        )
        out = []
        for c in first:
            for k in range(sampling.n):
                ids = self.tokenizer.encode(
                    self.script(c.request_index, k), add_special_tokens=False
                )
                out.append(
                    Completion(
                        request_index=c.request_index,
                        sample_index=k,
                        prompt_ids=c.prompt_ids,
                        response_ids=ids,
                        logprobs=[0.0] * len(ids),
                        finish_reason="stop",
                        request_id=c.request_id,
                        label_logprobs=c.label_logprobs,
                    )
                )
        return out

    async def stream(self, requests, sampling):
        for c in self.generate(requests, sampling):
            yield c

    def close(self):
        pass


def _expected_reward(model, prompt_ids, prefix_ids, tokenizer) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(prefix_ids)])).logits[0, -1].float()
    probs = torch.softmax(logits, -1)
    yes, no = (tokenizer.convert_tokens_to_ids(t) for t in ("Y", "N"))
    return float(2 * probs[yes] / (probs[yes] + probs[no]) - 1)


TEXTS = {
    0: "Yes",  # the label is the first token: its logprobs come with the generation
    1: "No",
    2: "The sum is right.\nVerdict: Yes",  # a forced step after "Verdict:"
    3: "Wrong carry.\nVerdict: No.",
    4: "Not correct",  # no verdict line: unparsable
    5: "Verdict: yes",  # parses as text, but the judge did not write the declared label
}


def _samples():
    return [Sample(prompt=f"{i}+{i}=", response=str(2 * i), reference=str(2 * i)) for i in TEXTS]


def _check(verdicts, judge, judge_dir, genrm):
    model = AutoModelForCausalLM.from_pretrained(judge_dir)
    tokenizer = judge.tokenizer
    for i, verdict in enumerate(verdicts):
        text = TEXTS[i]
        if i in (4, 5):
            assert (verdict.status, verdict.reward) == ("unparsable", genrm.default_reward)
            continue
        prompt_ids, _ = genrm.template.render_ids(_samples()[i], tokenizer)
        label_at = text.rfind("Yes" if "Yes" in text else "No")
        prefix = tokenizer.encode(text[:label_at], add_special_tokens=False)
        expected = _expected_reward(model, prompt_ids, prefix, tokenizer)
        assert verdict.status == "ok"
        assert verdict.reward == pytest.approx(expected, abs=1e-4)
        # The reward is the judge's probability, not the label it wrote.
        assert -1.0 < verdict.reward < 1.0


def test_blocking_scores_are_the_judges_yes_probability(real, judge_dir):
    judge = ScriptedJudge(real, lambda i, k: TEXTS[i])
    genrm = GenRM(judge, template=verification_template(), default_reward=-0.25)
    assert genrm.verdict_from == "label_logprobs"
    verdicts = genrm.score(_samples())
    _check(verdicts, judge, judge_dir, genrm)
    assert judge.num_forced_steps == 2  # samples 2 and 3; 0 and 1 needed none
    assert genrm.metrics["num_unparsable_votes"] == 2


def test_streamed_scores_match(real, judge_dir):
    judge = ScriptedJudge(real, lambda i, k: TEXTS[i])
    genrm = GenRM(judge, template=verification_template(), default_reward=-0.25)

    samples = _samples()

    async def run():
        for sample in samples:
            await genrm.submit(sample)
        await genrm.finish()
        return {v.sample_id: v async for v in genrm.results()}

    by_id = asyncio.run(run())
    _check([by_id[s.id] for s in samples], judge, judge_dir, genrm)


def test_votes_average_probabilities(real, judge_dir):
    judge = ScriptedJudge(real, lambda i, k: TEXTS[0] if k == 0 else TEXTS[2])
    genrm = GenRM(
        judge, template=verification_template(), votes=2, sampling=SamplingParams(temperature=1.0)
    )
    (verdict,) = genrm.score(_samples()[:1])
    rewards = [v.reward for v in verdict.votes]
    assert verdict.reward == pytest.approx(sum(rewards) / 2)
    assert rewards[0] != rewards[1]  # two places, two distributions


@pytest.mark.parametrize(
    "case", [c for c in CORPUS if c["parser"] == "yes_no" and c["expected"] is None][:60]
)
def test_adversarial_texts_stay_unparsable(real, case):
    judge = ScriptedJudge(real, lambda i, k: case["text"])
    genrm = GenRM(judge, template=verification_template())
    (verdict,) = genrm.score(_samples()[:1])
    assert verdict.status == "unparsable"
    assert judge.num_forced_steps == 0


def test_verdict_from_is_resolved_from_the_engine_and_parser(real):
    fake = FakeJudgeEngine(judge=lambda p, k: "Yes")
    assert GenRM(fake, template=verification_template()).verdict_from == "text"
    assert GenRM(real, template=verification_template()).verdict_from == "label_logprobs"
    scores = GenRM(real, template=verification_template(), parser=ScoreParser())
    assert scores.verdict_from == "text"
    text = GenRM(real, template=verification_template(), verdict_from="text")
    assert text.verdict_from == "text" and not text.sampling.label_token_ids
    with pytest.raises(ValueError, match="supports_label_logprobs"):
        GenRM(fake, template=verification_template(), verdict_from="label_logprobs")
    with pytest.raises(ValueError, match="verdict_from"):
        GenRM(fake, template=verification_template(), verdict_from="logits")


@pytest.mark.parametrize(
    ("yes", "no", "expected"),
    [
        (math.log(0.3), math.log(0.1), 0.5),  # P = 0.75
        (math.log(0.2), math.log(0.2), 0.0),
        (0.0, -1000.0, 1.0),
        (-1000.0, 0.0, -1.0),
    ],
)
def test_reward_is_two_p_minus_one(yes, no, expected):
    assert reward_from_label_logprobs(YesNoParser(), yes, no) == pytest.approx(expected)
    zero_one = YesNoParser(yes_reward=1.0, no_reward=0.0)
    assert reward_from_label_logprobs(zero_one, yes, no) == pytest.approx((expected + 1) / 2)
