"""Evaluation metrics per data source (pure functions): mean reward, pass@k with the unbiased estimator, mean@n,
and completion length.

pass@k (Chen et al., 2021, "Evaluating Large Language Models Trained on Code"): with n samples of a prompt of which
c pass, the chance that at least one of k drawn without replacement passes is 1 - C(n-c, k) / C(n, k), averaged
over prompts. It is unbiased for any k <= n, where "best of the first k" is not. A sample passes when its reward
reaches `pass_threshold` (1.0: the scorers' "right").
"""
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k)/C(n, k): the chance that k of the n samples, c of them passing, include a pass."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def eval_metrics(results: list, ks: list, pass_threshold: float, prefix: str = "eval") -> dict:
    """`results`: (data_source, [reward per sample], [length per sample]) per prompt, n samples each.
    Returns `{prefix}/<data_source>/{mean_reward, pass_at_<k>..., mean_at_<n>, length/mean, prompts}` and the same
    over all prompts under `{prefix}/all/` (pass@k is spelled pass_at_k: MLflow refuses "@" in a metric name)."""
    by_source: dict = {}
    for data_source, rewards, lengths in results:
        by_source.setdefault(data_source, []).append((rewards, lengths))
        by_source.setdefault("all", []).append((rewards, lengths))
    metrics = {}
    for source, prompts in sorted(by_source.items()):
        n = min(len(rewards) for rewards, _ in prompts)
        base = f"{prefix}/{source}"
        metrics[f"{base}/prompts"] = float(len(prompts))
        metrics[f"{base}/mean_reward"] = sum(sum(r) / len(r) for r, _ in prompts) / len(prompts)
        metrics[f"{base}/mean_at_{n}"] = metrics[f"{base}/mean_reward"]
        metrics[f"{base}/length/mean"] = sum(sum(l) / len(l) for _, l in prompts) / len(prompts)
        for k in ks:
            if k <= n:
                metrics[f"{base}/pass_at_{k}"] = sum(
                    pass_at_k(len(r), sum(x >= pass_threshold for x in r), k) for r, _ in prompts) / len(prompts)
    return metrics


def episode_metrics(played: list, prefix: str = "eval") -> dict:
    """`played`: (data_source, [Episode, ...]) per prompt. Returns `{prefix}/<data_source>/tool_use` (the share of
    episodes with at least one tool call) and `turns/mean` (model turns per episode), and both under `all`."""
    by_source: dict = {}
    for data_source, episodes in played:
        by_source.setdefault(data_source, []).extend(episodes)
        by_source.setdefault("all", []).extend(episodes)
    metrics = {}
    for source, episodes in sorted(by_source.items()):
        if episodes:
            metrics[f"{prefix}/{source}/tool_use"] = sum(e.tool_calls > 0 for e in episodes) / len(episodes)
            metrics[f"{prefix}/{source}/turns/mean"] = sum(e.turns for e in episodes) / len(episodes)
    return metrics
