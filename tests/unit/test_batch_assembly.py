"""Batch assembly on the learner (staleness, DAPO dynamic sampling, ReMax baselines, group size) and the
generator-side pieces that feed it (DAPO overlong shaping, greedy decoding for the ReMax baseline)."""
import numpy as np
import pytest
import torch

from asyncrl.buffer.group import Sampling
from asyncrl.generator.rewards.functions import overlong_penalty
from asyncrl.learner.batch import build_batch
from asyncrl.learner.collect import BatchFilter, BatchTimeout, collect_batch
from tests.queue_server import QueueServer, make_group


def test_dynamic_sampling_drops_zero_variance_groups_and_keeps_pulling():
    groups = [make_group([1, 1, 1]), make_group([0, 1, 0]), make_group([0, 0, 0]), make_group([1, 0, 1])]
    server = QueueServer(groups)
    out = collect_batch(server, 2, 1, 0, timeout_s=5, batch_filter=BatchFilter(dynamic_sampling=True))
    assert [g.rewards() for g in out.groups] == [[0, 1, 0], [1, 0, 1]]
    assert out.dropped["zero_variance"] == 2 and server.given_back == [groups[0].group_id, groups[2].group_id]
    assert server.reasons == ["zero_variance", "zero_variance"]  # a dealer keeps these prompts consumed


def test_when_the_data_ends_the_groups_in_hand_are_the_last_batch():
    """data.epochs ran out (the dealer's last prompt was taken): one group of two is trained, not waited for."""
    server = QueueServer([make_group([1, 0, 1])])
    out = collect_batch(server, 2, 1, 0, timeout_s=5, data_done=lambda: server.groups.empty())
    assert len(out.groups) == 1 and out.final
    assert not collect_batch(QueueServer([make_group([1, 0, 1])] * 2), 2, 1, 0, timeout_s=5,
                             data_done=lambda: False).final


def test_without_dynamic_sampling_zero_variance_groups_train():
    out = collect_batch(QueueServer([make_group([1, 1, 1]), make_group([0, 0, 0])]), 2, 1, 0, timeout_s=5,
                        batch_filter=BatchFilter())
    assert len(out.groups) == 2 and not out.dropped


def test_remax_groups_without_a_baseline_and_stale_ones_are_dropped_and_counted():
    groups = [make_group([1, 0, 1], version=5), make_group([1, 0, 1], version=4, baseline=0.5),
              make_group([0, 0, 1], version=3, baseline=1.0), make_group([1, 1, 0], version=5, baseline=0.0)]
    out = collect_batch(QueueServer(groups), 2, 1, 5, timeout_s=5,
                        batch_filter=BatchFilter(needs_baseline=True))
    assert dict(out.dropped) == {"no_baseline": 1, "stale": 1}
    assert [g.meta["baseline_reward"] for g in out.groups] == [0.5, 0.0]


def test_batch_timeout_names_what_was_dropped():
    with pytest.raises(BatchTimeout, match="zero_variance"):
        collect_batch(QueueServer([make_group([1, 1, 1])]), 2, 1, 0, timeout_s=0.3,
                      batch_filter=BatchFilter(dynamic_sampling=True))


def test_a_starved_learner_says_why_while_it_waits_and_when_it_gives_up(caplog):
    """An untrained policy under dynamic sampling: the generators drop every group before sending, and the learner
    says so every report_every_s instead of waiting in silence until its timeout."""
    with caplog.at_level("WARNING", logger="asyncrl.learner.collect"):
        with pytest.raises(BatchTimeout, match=r"0/2 groups.*'gen'.*dropped 5 groups whose samples all scored alike"):
            collect_batch(QueueServer([]), 2, 1, 0, timeout_s=0.5, report_every_s=0.1)
    reports = [r.getMessage() for r in caplog.records if "still waiting for a batch" in r.getMessage()]
    assert len(reports) >= 2 and "algo.dynamic_sampling" in reports[0]


def test_a_wait_only_quarantined_generators_could_fill_says_so_and_names_the_policys_own_drift():
    """One honest generator, quarantined because the policy diverged (lr 1e-3 on the vision demo): the learner
    waited out its timeout saying only how few groups it had."""
    server = QueueServer([make_group([1, 0, 1]) for _ in range(3)])
    with pytest.raises(BatchTimeout, match=r"refused the groups of quarantined generators \{'gen': 3\}.*learner.lr"):
        collect_batch(server, 2, 1, 0, timeout_s=0.5, refuse=lambda group: "quarantined: made-up logprobs")
    assert [reason for _, reason in server.quarantined] == ["quarantined"] * 3 and not server.given_back


def test_outcome_reward_sits_on_the_last_trained_token():
    group = make_group([0.25, -1.0], length=4)
    group.samples[1].loss_mask = np.array([1, 1, 0, 0], dtype=np.uint8)  # e.g. tool output at the end
    batch = build_batch([group])
    assert batch.token_rewards[0].nonzero().squeeze(-1).tolist() == [1 + 3]  # prompt 2 -> positions 1..4
    assert batch.token_rewards[1].nonzero().squeeze(-1).tolist() == [2]
    assert batch.token_rewards.sum(-1).tolist() == [0.25, -1.0]


@pytest.mark.parametrize("length, want", [(16384, 0.0), (18432, -0.5), (20480, -1.0), (20481, -1.0), (100, 0.0)])
def test_dapo_overlong_penalty_matches_the_paper(length, want):  # reference §5 T16
    assert overlong_penalty(length, max_tokens=20480, buffer_len=4096, factor=1.0) == pytest.approx(want)


def test_overlong_penalty_is_off_without_a_buffer_and_scales_with_the_factor():
    assert overlong_penalty(30, max_tokens=10, buffer_len=0, factor=1.0) == 0.0
    assert overlong_penalty(9, max_tokens=10, buffer_len=2, factor=0.5) == pytest.approx(-0.25)


def test_temperature_zero_is_greedy_in_the_hf_engine():
    from asyncrl.generator.engines.hf_engine import processed_log_probs

    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    log_probs = processed_log_probs(logits, Sampling(temperature=0.0))
    assert log_probs.exp().tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
