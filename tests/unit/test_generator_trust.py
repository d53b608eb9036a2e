"""learner/trust.py's rule on its own: per-group |ℓlearner - ℓμ| sums (algos/metrics.py), a quarantine only once a
generator's window is full and past the threshold, never for bf16 rounding, and none at all with the threshold 0.
The live job: tests/integration/test_generator_trust.py."""
from types import SimpleNamespace

import pytest
import torch

from asyncrl.algos.metrics import compute_group_abs_diff
from asyncrl.learner.config import LearnerConfig
from asyncrl.learner.trust import GeneratorTrust


def test_group_sums_count_each_valid_token_once_in_groups_of_any_size():
    learner = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0], [-3.0, 0.0, 0.0], [-1.0, -1.0, 0.0]])
    behav = torch.tensor([[-1.5, -1.0, 0.0], [-1.0, -1.0, -9.0], [-3.0, 0.0, 0.0], [-2.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
    assert compute_group_abs_diff(learner, behav, mask, [2, 2]) == [(1.5, 4), (1.0, 3)]
    assert compute_group_abs_diff(learner, behav, mask, [3, 1]) == [(1.5, 5), (1.0, 2)]  # per-turn samples


def groups_of(*generators):
    return [SimpleNamespace(generator_id=gen) for gen in generators]


def test_a_generator_is_quarantined_once_its_window_is_full_and_past_the_threshold():
    trust = GeneratorTrust(threshold_nats=1.0, window_groups=3)
    assert trust.note(groups_of("liar", "honest"), [(40.0, 10), (0.2, 10)], step=1) == []  # one group: not yet
    assert trust.note(groups_of("liar", "honest"), [(40.0, 10), (0.2, 10)], step=2) == []
    assert trust.note(groups_of("liar", "honest"), [(40.0, 10), (0.2, 10)], step=3) == ["liar"]
    assert trust.refusal(SimpleNamespace(generator_id="liar")).startswith("generator 'liar' is quarantined")
    assert trust.refusal(SimpleNamespace(generator_id="honest")) is None
    assert trust.metrics() == {"learner/quarantined_generators": 1.0}
    assert trust.per_generator(groups_of("liar", "honest", "honest"), [(4.0, 1), (1.0, 4), (0.0, 6)]) == {
        "honest": 0.1, "liar": 4.0}


def test_a_quarantine_that_leaves_no_trusted_generator_says_the_policy_may_have_moved(caplog):
    """Every generator past the threshold at once is what a diverging policy looks like (honest engines, a learning
    rate too high for the staleness): the log says that beside the quarantine, which stands (a liar that connected
    first looks the same, and tests/integration/test_generator_trust.py's honest generator connects after it)."""
    with caplog.at_level("ERROR", logger="asyncrl.learner.trust"):
        two = GeneratorTrust(threshold_nats=1.0, window_groups=1)
        assert two.note(groups_of("liar", "honest"), [(40.0, 10), (0.2, 10)], step=1) == ["liar"]
        assert "every generator" not in caplog.text
        alone = GeneratorTrust(threshold_nats=1.0, window_groups=1)
        assert alone.note(groups_of("engine"), [(40.0, 10)], step=1) == ["engine"]
    assert "every generator whose groups were trained is quarantined (engine)" in caplog.text
    assert "learner.lr" in caplog.text and alone.refusal(groups_of("engine")[0]) is not None


def test_bf16_rounding_of_every_logprob_never_trips_the_default():
    """An engine in bf16 against an fp32 learner: each logprob off by up to bf16's rounding (3 significant digits),
    far inside the default 1.0 nat."""
    learner = torch.distributions.Gamma(1.0, 1.0).sample((64, 32)).neg()  # logprobs of sampled tokens
    behav = learner.to(torch.bfloat16).float() + 0.02 * torch.randn(64, 32)  # rounding and kernel noise
    sums = compute_group_abs_diff(learner, behav, torch.ones(64, 32), [8] * 8)
    trust = GeneratorTrust(LearnerConfig().quarantine_abs_diff, window_groups=8)
    assert trust.note(groups_of(*["engine"] * 8), sums, step=1) == [] and trust.mean("engine") < 0.05


def test_threshold_zero_never_quarantines_and_bad_values_are_refused():
    trust = GeneratorTrust(threshold_nats=0.0, window_groups=1)
    assert trust.note(groups_of("liar"), [(1e6, 1)], step=1) == [] and trust.mean("liar") == 1e6
    with pytest.raises(ValueError, match="learner.quarantine_abs_diff"):
        LearnerConfig(quarantine_abs_diff=float("nan"))
    with pytest.raises(ValueError, match="learner.quarantine_window_groups"):
        LearnerConfig(quarantine_window_groups=0)


def test_a_quarantine_survives_the_checkpoint_and_a_resumed_learner_keeps_refusing():
    """The hour soak's liar had 22 and 28 of its 32 groups trained over four learner restarts: each resumed learner
    judged it afresh, with a new window. The quarantine now rides in the checkpoint's learner state."""
    from asyncrl.learner.state import LearnerState

    trust = GeneratorTrust(threshold_nats=1.0, window_groups=1)
    assert trust.note(groups_of("liar"), [(40.0, 10)], step=7) == ["liar"]
    state = LearnerState(version=7, quarantined=dict(trust.quarantined))
    resumed = GeneratorTrust(threshold_nats=1.0, window_groups=1,
                             quarantined=LearnerState.from_json(state.to_json()).quarantined)
    assert resumed.refusal(SimpleNamespace(generator_id="liar")) == trust.quarantined["liar"]
    assert "at step 7" in resumed.refusal(SimpleNamespace(generator_id="liar"))
    assert resumed.metrics() == {"learner/quarantined_generators": 1.0}
    older = {key: value for key, value in state.to_json().items() if key != "quarantined"}  # a checkpoint from before
    assert LearnerState.from_json(older).quarantined == {}
