"""The shared train step (yatt.core.policy._train_step) through a fake backend of its hooks: a
"model" that is one logit vector, so the full-batch gradient has a closed form. Checks the
loss normalisation against it whatever the micro-batching, dummy micro-batches, both skips,
the metrics' keys, the logprobs pass, and that both real backends provide every hook."""

import contextlib
import inspect

import pytest
import torch

from yatt.core import Batch, MegatronPolicy, PolicyLoss, TorchPolicy
from yatt.core.policy._train_step import StepBackend, StepCounts, compute_logprobs, run_train_step

NUM_GPUS = 0
VOCAB = 7


class FakeBackend:
    """log p(token) = log_softmax(theta)[token] at every position: no context, one parameter."""

    def __init__(self, bins=None, *, found_inf=False):
        self.device = torch.device("cpu")
        self.dp_size = 1
        self.theta = torch.nn.Parameter(torch.linspace(-1.0, 1.0, VOCAB))
        self.bins = bins
        self.found_inf = found_inf
        self.calls: list[str] = []
        self.lrs: list[float] = []

    @property
    def dp_group(self):
        return None

    def plan_micro_batches(self, batch):
        self.calls.append("plan")
        return self.bins if self.bins is not None else [list(range(len(batch)))]

    def forward_micro_batch(self, mb, *, needs_entropy, is_training):
        self.calls.append("forward_train" if is_training else "forward_eval")
        logprobs_V = torch.log_softmax(self.theta, -1)
        logprobs_BT = logprobs_V[mb["input_ids"]]
        logprobs_BT = torch.cat([torch.zeros_like(logprobs_BT[:, :1]), logprobs_BT[:, 1:]], 1)
        entropy = -(logprobs_V.exp() * logprobs_V).sum()
        entropy_BT = entropy.expand(logprobs_BT.shape) if needs_entropy else None
        return logprobs_BT, entropy_BT

    def grad_sync(self, *, is_last):
        self.calls.append(f"sync_last={is_last}")
        return contextlib.nullcontext()

    def zero_grad(self):
        self.calls.append("zero_grad")
        self.theta.grad = None

    def reduce_and_clip_grads(self, max_norm):
        self.calls.append(f"clip_to={max_norm}")
        norm = self.theta.grad.norm() if self.theta.grad is not None else torch.zeros(())
        return float(norm), self.found_inf

    def step_optimizer(self, lr):
        self.calls.append("step")
        self.lrs.append(lr)
        with torch.no_grad():
            self.theta -= lr * self.theta.grad  # SGD: the update shows the gradient itself


def _batch(lengths=(5, 3, 6, 2), advantages=(1.0, -0.5, 0.25, 2.0)):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for length, advantage in zip(lengths, advantages, strict=True):
        mask = torch.zeros(length, dtype=torch.int64)
        mask[1:] = 1
        ids = torch.randint(0, VOCAB, (length,), generator=gen)
        rows.append({"input_ids": ids, "loss_mask": mask, "advantages": advantage})
    return Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])


def _expected_step(batch, loss_fn, lr):
    """theta after one SGD step on the mean loss over the whole batch, by autograd at once."""
    backend = FakeBackend()
    logprobs_BT, entropy_BT = backend.forward_micro_batch(
        batch, needs_entropy=True, is_training=True
    )
    loss_sum, _ = loss_fn(batch, logprobs_BT, entropy_BT)
    (loss_sum / loss_fn.count_units(batch)).backward()
    return (backend.theta - lr * backend.theta.grad).detach()


@pytest.mark.parametrize(
    "bins",
    [
        pytest.param([[0, 1, 2, 3]], id="one"),
        pytest.param([[0], [1], [2], [3]], id="per-sample"),
        pytest.param([[2, 0], [], [3, 1], []], id="with-dummies"),
    ],
)
@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
def test_step_is_the_full_batch_mean_gradient_however_split(bins, aggregation):
    loss_fn = PolicyLoss(
        aggregation=aggregation, max_response_tokens=9, is_on_policy=True, entropy_coef=0.1
    )
    backend = FakeBackend(bins)
    counts = StepCounts()
    metrics = run_train_step(
        backend, _batch(), loss_fn, counts=counts, lr_at=lambda step: 0.5, max_grad_norm=None
    )
    torch.testing.assert_close(
        backend.theta.detach(), _expected_step(_batch(), loss_fn, 0.5), atol=1e-6, rtol=0
    )
    assert backend.lrs == [0.5] and metrics["lr"] == 0.5
    assert metrics["num_micro_batches"] == len(bins) and metrics["num_loss_tokens"] == 12
    assert metrics["is_skipped"] == 0.0 and counts.num_steps == 1 and counts.num_skipped_steps == 0
    # Gradients are synced in the last micro-batch only, and cleared before and after.
    syncs = [c for c in backend.calls if c.startswith("sync")]
    assert syncs == ["sync_last=False"] * (len(bins) - 1) + ["sync_last=True"]
    assert backend.calls[0] == "zero_grad" and backend.calls[-1] == "zero_grad"
    assert backend.calls.index("clip_to=None") < backend.calls.index("step")
    # The entropy metric is a per-token mean, whatever the aggregation (here a constant).
    _, entropy_BT = FakeBackend().forward_micro_batch(
        _batch(), needs_entropy=True, is_training=False
    )
    assert metrics["entropy"] == pytest.approx(float(entropy_BT[0, 0].detach()))


def test_metrics_are_token_means_and_the_loss_is_the_unit_mean():
    # ratio 1: pg loss per token = -advantage
    loss_fn = PolicyLoss(objective="dapo", is_on_policy=True)
    metrics = run_train_step(
        FakeBackend([[0, 1], [2, 3]]),
        _batch(),
        loss_fn,
        counts=StepCounts(),
        lr_at=lambda step: 0.1,
        max_grad_norm=None,
    )
    # Tokens with loss: 4, 2, 5, 1 (all but the first of each row).
    expected = -(4 * 1.0 + 2 * -0.5 + 5 * 0.25 + 1 * 2.0) / 12
    assert metrics["loss"] == pytest.approx(expected) and metrics["pg_loss"] == pytest.approx(
        expected
    )
    assert set(metrics) == {
        "loss",
        "pg_loss",
        "clip_frac",
        "clip_frac_low",
        "clip_frac_high",
        "clip_frac_dual",
        "grad_norm",
        "lr",
        "num_micro_batches",
        "num_loss_tokens",
        "is_skipped",
    }


@pytest.mark.parametrize(
    ("found_inf", "advantage"),
    [pytest.param(True, 1.0, id="found-inf"), pytest.param(False, float("nan"), id="nan-loss")],
)
def test_non_finite_step_skips_the_optimizer_and_clears_gradients(found_inf, advantage):
    backend = FakeBackend(found_inf=found_inf)
    before = backend.theta.detach().clone()
    counts = StepCounts()
    batch = _batch(advantages=(advantage, 1.0, 1.0, 1.0))
    metrics = run_train_step(
        backend,
        batch,
        PolicyLoss(is_on_policy=True),
        counts=counts,
        lr_at=lambda step: 0.1,
        max_grad_norm=1.0,
    )
    assert metrics["is_skipped"] == 1.0 and "step" not in backend.calls
    assert torch.equal(backend.theta.detach(), before) and backend.theta.grad is None
    assert (counts.num_steps, counts.num_skipped_steps) == (1, 1)


def test_batch_without_loss_tokens_skips_before_any_forward():
    backend = FakeBackend()
    counts = StepCounts()
    healthy = run_train_step(
        FakeBackend(),
        _batch(),
        PolicyLoss(is_on_policy=True),
        counts=StepCounts(),
        lr_at=lambda step: 0.1,
        max_grad_norm=None,
    )
    metrics = run_train_step(
        backend,
        _batch().select([]),
        PolicyLoss(is_on_policy=True),
        counts=counts,
        lr_at=lambda step: 0.1,
        max_grad_norm=None,
    )
    assert backend.calls == [] and metrics["is_skipped"] == 1.0 and metrics["lr"] == 0.1
    # Same bookkeeping keys as a step that ran (the loss's own metrics aside).
    assert set(metrics) == {k for k in healthy if not k.startswith(("pg_loss", "clip_frac"))}
    assert (counts.num_steps, counts.num_skipped_steps) == (0, 1)


def test_lr_follows_applied_updates_and_zero_clip_measures_only():
    """The schedule is asked for the number of updates applied: a skipped step repeats its lr."""
    asked = []

    def lr_at(step):
        asked.append(step)
        return 0.1 / (step + 1)

    counts = StepCounts()
    lrs = []
    for advantage in (1.0, float("nan"), 1.0):
        backend = FakeBackend()
        batch = _batch(advantages=(advantage, 1.0, 1.0, 1.0))
        loss = PolicyLoss(is_on_policy=True)
        metrics = run_train_step(backend, batch, loss, counts=counts, lr_at=lr_at, max_grad_norm=0)
        lrs.append(metrics["lr"])
    assert asked == [0, 1, 1] and lrs == [0.1, 0.05, 0.05]
    assert (counts.num_steps, counts.num_skipped_steps, counts.num_optimizer_steps) == (3, 1, 2)
    assert "clip_to=None" in backend.calls  # max_grad_norm=0: no clipping, the norm measured
    restored = StepCounts()
    restored.load_state_dict(counts.state_dict())
    assert restored == counts


def test_logprobs_pass_fills_each_sample_and_leaves_padding_and_dummies_out():
    backend = FakeBackend([[3], [], [0, 2], [1]])
    batch = _batch()
    got = compute_logprobs(backend, batch)
    assert "forward_train" not in backend.calls and not got.requires_grad
    logprobs_V = torch.log_softmax(backend.theta.detach(), -1)
    for i, length in enumerate(batch.lengths.tolist()):
        expected = logprobs_V[batch["input_ids"][i, 1:length]]
        torch.testing.assert_close(got[i, 1:length], expected)
        assert got[i, 0] == 0 and (got[i, length:] == 0).all()


@pytest.mark.parametrize("backend_cls", [TorchPolicy, MegatronPolicy])
def test_both_policy_backends_provide_every_hook(backend_cls):
    """The real backends run this same code: each has every hook, with the protocol's signature."""
    hooks = [name for name in vars(StepBackend) if not name.startswith("_")]
    assert set(hooks) >= {"plan_micro_batches", "forward_micro_batch", "step_optimizer"}
    for name in hooks:
        want = getattr(StepBackend, name)
        got = getattr(backend_cls, name, None)
        assert got is not None, f"{backend_cls.__name__}.{name}"
        if inspect.isfunction(want):
            assert (
                inspect.signature(got).parameters.keys()
                == inspect.signature(want).parameters.keys()
            ), name
