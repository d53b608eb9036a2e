"""How far `asyncrl plan` (planner/simulate.py) can be trusted, against two references (it reports; it does not
assert).

1. `closed-form`: Applied Compute's closed form for the mean staleness of fully asynchronous RL
   (planner/closed_form.py), over a grid of its parameters: concurrency C, batch B, group size n, utilization ρ,
   queue factor q and the length tail (lognormal σ, giving M_tail). The simulator runs in that model's setting:
   continuous batching with C sequence slots at a fixed speed each, in-flight updates, no admission limit, an
   evicting queue of q·B groups. ρ and M_tail are measured in the simulation, as the post measured them in runs.
   error = (closed form − simulated) / simulated.
2. `runs`: finished CPU runs of the demo (job directories with config.yaml, progress.jsonl and the lengths in
   trained_groups.jsonl). The inputs are measured from `--calibrate` (one run); each run is then planned with its
   own generators and η, and the plan's steps/s and mean staleness compared with the run's.

The last line is JSON: the largest absolute error of each check.
"""
import argparse
import json
import math
import random

from asyncrl.planner.closed_form import mean_staleness, tailness
from asyncrl.planner.from_run import measure_run
from asyncrl.planner.simulate import Fleet, Learner, Queue, simulate

GRID = {"concurrency_over_batch": (0.5, 1.0, 2.0), "rho": (0.5, 0.8, 1.25, 2.0), "queue_factor": (1, 2),
        "sigma": (0.3, 0.9), "n": (4, 8)}


def closed_form_point(concurrency: int, groups: int, n: int, rho: float, queue_factor: int, sigma: float,
                      steps: int, seed: int) -> dict:
    mean_len, tokens_per_s = 100.0, 10.0
    mu = math.log(mean_len) - sigma * sigma / 2
    lengths = lambda rng, k: [rng.lognormvariate(mu, sigma) for _ in range(k)]  # noqa: E731
    batch = groups * n
    train_s = batch / (concurrency * tokens_per_s / mean_len / rho)
    result = simulate(Fleet(generators=1, slots=10**9, n=n, gen_tokens_per_s=tokens_per_s, engine="slots",
                            seq_slots=concurrency),
                      Learner(groups_per_step=groups, max_staleness=10**9, train_s_per_step=train_s),
                      Queue(admission=False, capacity=queue_factor * groups), lengths, steps=steps, seed=seed,
                      warmup_steps=steps // 5)
    rho_measured = result.produced_groups * n / result.wall_s / (batch / train_s)
    rng = random.Random(seed + 1)
    m_tail = tailness([lengths(rng, n) for _ in range(4000)])
    predicted = mean_staleness(concurrency, batch, rho_measured, m_tail, queue_factor)
    return {"C": concurrency, "B": batch, "n": n, "q": queue_factor, "sigma": sigma, "rho": rho_measured,
            "m_tail": m_tail, "simulated": result.staleness_mean, "closed_form": predicted,
            "error": (predicted - result.staleness_mean) / result.staleness_mean}


def check_closed_form(steps: int, seed: int, grid: dict = GRID) -> list:
    rows = []
    for n in grid["n"]:
        groups = 64 // n
        for ratio in grid["concurrency_over_batch"]:
            for rho in grid["rho"]:
                for q in grid["queue_factor"]:
                    for sigma in grid["sigma"]:
                        rows.append(closed_form_point(int(ratio * 64), groups, n, rho, q, sigma, steps, seed))
    print(f"{'C':>4} {'B':>4} {'n':>3} {'q':>2} {'sigma':>5} {'rho':>5} {'M_tail':>6} {'simulated':>9} "
          f"{'closed form':>11} {'error':>7}")
    for row in rows:
        print(f"{row['C']:>4} {row['B']:>4} {row['n']:>3} {row['q']:>2} {row['sigma']:>5.1f} {row['rho']:>5.2f} "
              f"{row['m_tail']:>6.2f} {row['simulated']:>9.2f} {row['closed_form']:>11.2f} {row['error']:>+7.1%}")
    return rows


def check_runs(calibrate: str, runs: list, steps: int, seed: int) -> list:
    from asyncrl.configs import load_config
    from asyncrl.launch.plan import check_against_run, describe, inputs_of, plan_one, row_of

    base = measure_run(calibrate)
    inputs = inputs_of(base)
    print(f"calibrated on {calibrate}: {describe(base)}")
    rows = []
    for job_dir in runs:
        measured = measure_run(job_dir)
        cfg = load_config(f"{job_dir}/config.yaml", [])
        eta = cfg.buffer.max_staleness
        plan = plan_one(cfg, measured.generators, eta, inputs, steps, seed)
        rows.append({"run": job_dir, "generators": measured.generators, "eta": eta,
                     **check_against_run(measured, row_of(measured.generators, eta, plan))})
    print(f"{'generators':>10} {'eta':>4} {'steps/s run':>11} {'plan':>7} {'error':>7} {'staleness run':>13} "
          f"{'plan':>6} {'error':>7} {'learner idle run':>16} {'plan':>5}")
    for row in rows:
        print(f"{row['generators']:>10} {row['eta']:>4} {row['measured_steps_per_s']:>11.3f} "
              f"{row['planned_steps_per_s']:>7.3f} {row['steps_per_s_error']:>+7.1%} "
              f"{row['measured_staleness_mean']:>13.2f} {row['planned_staleness_mean']:>6.2f} "
              f"{row['staleness_error']:>+7.1%} {row['measured_learner_idle']:>16.2f} "
              f"{row['planned_learner_idle']:>5.2f}")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="simulated learner steps per point")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calibrate", default=None, help="the job directory the run check measures inputs from")
    parser.add_argument("--runs", nargs="*", default=[], help="job directories to plan and compare")
    parser.add_argument("--small", action="store_true", help="a 4-point grid (the test's setting)")
    args = parser.parse_args(argv)
    grid = GRID if not args.small else {"concurrency_over_batch": (1.0,), "rho": (0.5, 2.0), "queue_factor": (1, 2),
                                        "sigma": (0.6,), "n": (4,)}
    out: dict = {"bench": "plan_check"}
    rows = check_closed_form(args.steps, args.seed, grid)
    errors = [abs(row["error"]) for row in rows]
    out["closed_form"] = {"points": len(rows), "max_abs_error": max(errors), "mean_abs_error": sum(errors) / len(rows)}
    if args.runs:
        runs = check_runs(args.calibrate or args.runs[0], args.runs, args.steps, args.seed)
        out["runs"] = {"runs": len(runs),
                       "max_abs_steps_per_s_error": max(abs(row["steps_per_s_error"]) for row in runs),
                       "max_abs_staleness_error": max(abs(row["staleness_error"]) for row in runs)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
