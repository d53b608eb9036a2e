"""telemetry/eval_metrics.py: the unbiased pass@k estimator against brute-force enumeration, and per-source metrics."""
import itertools

import pytest

from asyncrl.telemetry.eval_metrics import eval_metrics, pass_at_k


@pytest.mark.parametrize("n, c", [(1, 0), (1, 1), (4, 1), (5, 2), (6, 6), (7, 3)])
def test_pass_at_k_is_the_chance_that_k_of_n_samples_include_a_pass(n, c):
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        draws = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_metrics_per_data_source_and_over_all():
    results = [("gsm8k", [1.0, 0.0, 0.0, 0.0], [10, 20, 30, 40]), ("gsm8k", [1.0, 1.0, 1.0, 1.0], [5, 5, 5, 5]),
               ("math", [0.5, 0.0, 0.0, 0.0], [8, 8, 8, 8])]
    metrics = eval_metrics(results, ks=[1, 2, 8], pass_threshold=1.0)
    assert metrics["eval/gsm8k/prompts"] == 2.0 and metrics["eval/all/prompts"] == 3.0
    assert metrics["eval/gsm8k/mean_reward"] == pytest.approx((0.25 + 1.0) / 2) == metrics["eval/gsm8k/mean_at_4"]
    assert metrics["eval/gsm8k/pass_at_1"] == pytest.approx((0.25 + 1.0) / 2)
    assert metrics["eval/gsm8k/pass_at_2"] == pytest.approx((0.5 + 1.0) / 2)  # 1 - C(3,2)/C(4,2) = 0.5
    assert metrics["eval/math/pass_at_1"] == 0.0  # 0.5 is below the threshold
    assert metrics["eval/gsm8k/length/mean"] == pytest.approx((25 + 5) / 2)
    assert "eval/gsm8k/pass_at_8" not in metrics  # k above n is not estimable
