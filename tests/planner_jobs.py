"""A finished job directory, as the planner reads one, without running a job."""
import json


def write_job(path, steps=20, gens=2, eta=1, filtered_per_step=0):
    """A finished job directory as the learner writes it: progress, trained groups with lengths, summary,
    config. `filtered_per_step`: groups dynamic sampling dropped per step (the fleet's running total, logged)."""
    from asyncrl.configs import load_config, to_yaml

    path.mkdir()
    with open(path / "progress.jsonl", "w") as handle:
        for step in range(1, steps + 1):
            handle.write(json.dumps({"step": step, "elapsed_s": 2.0 * step, "timing/learner/wait_for_batch_s": 0.5,
                                     "perf/generator/tokens_per_s": 300.0, "timing/generator/idle_frac": 0.25,
                                     "buffer/staleness/mean": 1.0, "timing/learner/idle_frac": 0.25,
                                     "generator/filtered_groups": float(filtered_per_step * step)}) + "\n")
    with open(path / "trained_groups.jsonl", "w") as handle:
        for step in range(1, steps + 1):
            handle.write(json.dumps({"step": step, "groups": ["a", "b", "c", "d"], "prompts": ["p"] * 4,
                                     "lengths": [[10, 20, 30, 40]] * 4}) + "\n")
    (path / "summary.json").write_text(json.dumps({"generators": {f"gen-{i}": {} for i in range(gens)}}))
    (path / "config.yaml").write_text(to_yaml(load_config(None, [f"buffer.max_staleness={eta}",
                                                                 "buffer.groups_per_step=4", "rollout.n=4"])))
    return path
