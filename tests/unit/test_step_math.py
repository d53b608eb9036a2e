"""The learner's speed-ups keep its math: train_step equals a hand-written loop of the demo recipe's algorithm, and
the CPU optimizer's fused AdamW steps like torch's default one."""
import copy

import torch

from asyncrl.algos.config import AlgoConfig
from asyncrl.bench.learner import DEMO_ALGO, plain_step, skewed_groups
from asyncrl.learner.build import build_optimizer
from asyncrl.learner.config import LearnerConfig
from asyncrl.learner.model import build_qwen2
from asyncrl.learner.train_step import StepSettings, train_step


class GradientRecorder(torch.optim.Optimizer):
    """Keeps the (clipped) gradient it is asked to step on, and changes nothing."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})
        self.grads = None

    def step(self, closure=None):
        self.grads = [param.grad.clone() for group in self.param_groups for param in group["params"]]


def one_step(model, step) -> tuple:
    model = copy.deepcopy(model)
    optimizer = GradientRecorder(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return step(model, optimizer, scheduler), optimizer.grads


def test_train_step_matches_a_plain_loop_of_the_demo_recipes_math():
    """A-3PO's π_prox at α = 1/2 (groups two versions stale) and 0, the decoupled weight, PPO clip, GRPO, token
    mean over several length-sorted micro-batches, clipping: the loss and gradient of the plain loop (fp64)."""
    model = build_qwen2(vocab_size=512, hidden_size=64, num_layers=1, eos_token_id=1, pad_token_id=0,
                        seed=0).double()
    groups = skewed_groups(4, 4, short=6, long=12, long_frac=0.3, seed=3, stale_every=2)
    for group in groups[::2]:  # version 0 at learner version 2
        for sample in group.samples:
            sample.versions[:] = 0
    settings = StepSettings(version=2, max_staleness=2, max_tokens_per_microbatch=100, chunk_tokens=7, grad_clip=1e-3)
    algo = AlgoConfig(**DEMO_ALGO)
    metrics, grads = one_step(model, lambda m, o, s: train_step(m, o, s, groups, algo, settings).metrics)
    loss, plain_grads = one_step(model, lambda m, o, s: plain_step(m, o, s, groups, 2, 100, grad_clip=1e-3))
    assert abs(metrics["loss/pg"] - loss) < 1e-10 and loss != 0.0
    assert metrics["policy/grad_norm"] > 1e-3  # the clip was active
    for got, expected in zip(grads, plain_grads):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-8)


def test_the_cpu_learner_steps_with_fused_adamw_like_the_default_adamw():
    model = build_qwen2(vocab_size=64, hidden_size=32, num_layers=1, eos_token_id=1, pad_token_id=0, seed=0)
    other, start = copy.deepcopy(model), copy.deepcopy(model)
    fused, _ = build_optimizer(model, LearnerConfig(lr=1e-2, warmup_steps=0))
    default = torch.optim.AdamW(other.parameters(), lr=1e-2, weight_decay=fused.defaults["weight_decay"],
                                betas=fused.defaults["betas"], foreach=False)
    assert fused.defaults["fused"] and not default.defaults["fused"]
    torch.manual_seed(0)
    for _ in range(3):
        for left, right in zip(model.parameters(), other.parameters()):
            left.grad = torch.randn_like(left)
            right.grad = left.grad.clone()
        fused.step()
        default.step()
    for left, right in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(left, right, atol=1e-6, rtol=1e-5)
    assert not torch.equal(model.lm_head.weight, start.lm_head.weight)  # the steps moved the weights
