"""The soak's checker: it reads what a job left behind, not what the job says of itself, and tells whether the
history holds. Jepsen's way: the faults are injected by one party, the invariants checked afterwards by another,
from records the job could not have bent to hide a failure.

What it reads, from the job directory:
- `trained_groups.jsonl`, the learner's audit trail, one line per trained step and life (telemetry/run_record.py):
  the groups, their prompts and, where recorded, the generator that sent each and its staleness. A resumed learner
  retrains from its checkpoint's step on, so a line whose step does not follow the previous one starts a new life,
  which replaces what the previous life recorded from that step on: the timeline the final model saw.
- `progress.jsonl`, one line per step and life: the sampled reward, read the same way.
- the MLflow store the generators report into (each logs `<id>/generator/version`, its engine's weight version, with
  every report and once more as it stops), when given.
- the training files, for the prompts an epoch must cover.

The invariants (each a list of violations; the history holds when all are empty):
- **exactly once**: over the effective timeline, no prompt was trained more often than the dealer dealt it, nor
  left behind. The dealer's cursor when the job stopped (`data/epoch` of its last progress row, C) says how often
  it dealt each prompt: floor(C) or ceil(C) times. So a prompt trained more than ceil(C) times is duplicated, and
  one trained fewer than floor(C) - 1 times is lost: a prompt may be one short for a deal still out (held by a
  generator, waiting in the buffer, or given back and not yet dealt again), and the dealer deals a lapped prompt
  anew rather than waiting for its old deal, so that deal costs one training whatever its age. A prompt lost in
  the last lap therefore reads as still out; every earlier loss is caught. No trained prompt may be foreign to the
  data. Prompts the generators' filter dropped (dynamic sampling) are consumed without being trained: give them
  as `consumed_elsewhere`, or run the soak with the filter off.
- **bounded staleness**: no trained group's staleness exceeds η.
- **steps move forward**: within a life the steps are consecutive (a gap is a trained step with no record); a
  resumed life starts at or before the previous life's last step (from its checkpoint), never past it.
- **no hostile group trained**: no trained group came from a generator named hostile.
- **generators end on the last version**: each generator's last reported version is the learner's last published
  one (the version after its last step), or at most η behind it: the learner is stopped first, and a version it
  published just before reaches only a generator that asks again. A generator stuck on an older version, or on a
  version of a learner life the timeline replaced (past the last step), fails.
- **it learned**: the mean sampled reward of the last `window` steps exceeds that of the first `window`.
"""
import argparse
import json
import math
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field


def read_jsonl(path: str) -> list:
    """The rows of a JSON-lines file; none when it does not exist (a job that never trained a step)."""
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def learner_lives(rows: list) -> list:
    """(first step, last step) of each learner life, in order: a row whose step does not follow the previous row's
    starts a life."""
    lives = []
    for row in rows:
        if lives and row["step"] > lives[-1][1]:
            lives[-1] = (lives[-1][0], row["step"])
        else:
            lives.append((row["step"], row["step"]))
    return lives


def effective_timeline(rows: list) -> dict:
    """step -> row, as the final model saw it: a resumed life replaces what earlier lives recorded from its first
    step on."""
    timeline, last = {}, 0
    for row in rows:
        if row["step"] <= last:
            timeline = {step: kept for step, kept in timeline.items() if step < row["step"]}
        timeline[row["step"]] = row
        last = row["step"]
    return dict(sorted(timeline.items()))


def step_gaps(rows: list) -> list:
    """Steps trained with no record: a row whose step is past the step after the previous row's (a resumed life
    starts at or before the previous row's step, from its checkpoint, so it cannot skip one)."""
    return [f"step {before['step']} is followed by step {after['step']}" for before, after in zip(rows, rows[1:])
            if after["step"] > before["step"] + 1]


def prompt_violations(timeline: dict, data: list, consumed_elsewhere: Counter, cursor: float | None) -> dict:
    """Exactly once over the timeline (the module docstring): (epochs completed, lost, duplicated, foreign), each
    prompt named with its count. `cursor` is the dealer's `data/epoch` when the job stopped; without one (a job
    that logged none), the epochs the trained prompts cover stand in for it, which reads a job stopped with many
    prompts out as fewer epochs than it dealt."""
    counts = Counter(prompt for row in timeline.values() for prompt in row["prompts"]) + consumed_elsewhere
    known = set(data)
    if cursor is None:
        cursor = sum(counts[prompt] for prompt in known) / len(known) if known else 0.0
    dealt_most, dealt_least = math.ceil(cursor), math.floor(cursor)
    return {"epochs": dealt_least,
            "lost": sorted(f"{p} x{counts[p]}" for p in known if counts[p] < dealt_least - 1),
            "duplicated": sorted(f"{p} x{counts[p]}" for p in known if counts[p] > dealt_most),
            "foreign": sorted(f"{p} x{c}" for p, c in counts.items() if p not in known)}


def group_violations(timeline: dict, max_staleness: int, hostile: set, liar: str) -> tuple[list, list, int, bool]:
    """(stale groups, hostile groups trained, the liar's groups trained, whether the rows record generators and
    staleness at all)."""
    stale, hostile_trained, liar_trained, recorded = [], [], 0, True
    for step, row in timeline.items():
        if "staleness" not in row or "generators" not in row:
            recorded = False
            continue
        for group, staleness, generator in zip(row["groups"], row["staleness"], row["generators"]):
            if staleness > max_staleness:
                stale.append(f"step {step}: group {group} from {generator} at staleness {staleness} > {max_staleness}")
            if generator in hostile:
                hostile_trained.append(f"step {step}: group {group} from hostile generator {generator}")
            liar_trained += generator == liar
    return stale, hostile_trained, liar_trained, recorded


def generator_final_versions(tracking_uri: str, generators: list) -> dict:
    """generator id -> the version in its last `<id>/generator/version` report (by time), across every run of the
    store (a resumed learner opens a run of its own); a generator that never reported is absent."""
    from mlflow.tracking import MlflowClient

    client, last = MlflowClient(tracking_uri), {}
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            for generator in generators:
                for metric in client.get_metric_history(run.info.run_id, f"{generator}/generator/version"):
                    if generator not in last or metric.timestamp >= last[generator][0]:
                        last[generator] = (metric.timestamp, int(metric.value))
    return {generator: version for generator, (_, version) in last.items()}


def version_violations(finals: dict, generators: list, last_published: int, max_staleness: int) -> list:
    """Generators that did not end within η of the learner's last published version, or never reported."""
    problems = [f"{generator} reported no version" for generator in generators if generator not in finals]
    return problems + [f"{generator} ended on v{version}, the learner's last published version is v{last_published}"
                       f" (η {max_staleness})" for generator, version in sorted(finals.items())
                       if not last_published - max_staleness <= version <= last_published]


def mean_reward(rows: list) -> float | None:
    values = [row["reward/sampled_mean"] if "reward/sampled_mean" in row else row["reward/mean"] for row in rows]
    return sum(values) / len(values) if values else None


@dataclass
class HistoryReport:
    steps: int
    lives: list
    groups: int
    epochs: int
    lost: list = field(default_factory=list)
    duplicated: list = field(default_factory=list)
    foreign: list = field(default_factory=list)
    stale: list = field(default_factory=list)
    hostile_trained: list = field(default_factory=list)
    gaps: list = field(default_factory=list)
    reward_before: float | None = None
    reward_after: float | None = None
    liar_trained: int = 0
    """Groups trained from the generator named the liar (plausible groups with made-up logprobs: trained until its
    quarantine, so the soak bounds them rather than forbidding them)."""
    last_step: int = 0
    """The timeline's last step: the version the learner published last."""
    final_versions: dict = field(default_factory=dict)
    """generator -> its engine's version when it stopped (empty when the checker was given no MLflow store)."""
    versions: list = field(default_factory=list)
    """Generators that did not end within η of the last published version (`version_violations`)."""
    groups_recorded: bool = True
    """False when trained_groups.jsonl lacks generators and staleness (a job from before they were recorded): the
    staleness and hostile checks then had nothing to read, which is a failure, not a pass."""

    def problems(self) -> list:
        if not self.steps:
            return ["no step was trained"]
        problems = [f"{name}: {', '.join(values[:5])}{' ...' if len(values) > 5 else ''} ({len(values)})"
                    for name, values in (("lost", self.lost), ("duplicated", self.duplicated),
                                         ("foreign", self.foreign), ("stale", self.stale),
                                         ("hostile trained", self.hostile_trained), ("step gaps", self.gaps),
                                         ("generator versions", self.versions))
                    if values]
        if not self.groups_recorded:
            problems.append("trained_groups.jsonl records no generators or staleness: those checks could not run")
        if self.reward_before is None or self.reward_after is None or self.reward_after <= self.reward_before:
            problems.append(f"the sampled reward did not rise: {self.reward_before} -> {self.reward_after}")
        return problems


def check_history(groups_rows: list, progress_rows: list, data: list, max_staleness: int, hostile=(),
                  consumed_elsewhere: Counter | None = None, window: int = 20, liar: str = "",
                  final_versions: dict | None = None, generators: list = ()) -> HistoryReport:
    """The invariants of the module docstring over a job's records (rows of trained_groups.jsonl and of
    progress.jsonl, in file order), its data's prompt ids and, when given, `generators`' `final_versions`
    (generator_final_versions)."""
    timeline = effective_timeline(groups_rows)
    progress = list(effective_timeline(progress_rows).values())
    cursor = progress[-1].get("data/epoch") if progress else None
    prompts = prompt_violations(timeline, data, consumed_elsewhere or Counter(), cursor)
    stale, hostile_trained, liar_trained, recorded = group_violations(timeline, max_staleness, set(hostile), liar)
    return HistoryReport(steps=len(timeline), lives=learner_lives(groups_rows),
                         groups=sum(len(row["groups"]) for row in timeline.values()), epochs=prompts["epochs"],
                         lost=prompts["lost"], duplicated=prompts["duplicated"], foreign=prompts["foreign"],
                         stale=stale, hostile_trained=hostile_trained, gaps=step_gaps(groups_rows),
                         reward_before=mean_reward(progress[:window]), reward_after=mean_reward(progress[-window:]),
                         liar_trained=liar_trained, groups_recorded=recorded, last_step=max(timeline, default=0),
                         final_versions=final_versions or {},
                         versions=version_violations(final_versions or {}, list(generators), max(timeline, default=0),
                                                     max_staleness) if generators else [])


def data_prompt_ids(files: list) -> list:
    """The prompt ids a job deals from `files` (data/prompts.py::read_rows names each row)."""
    from asyncrl.data.prompts import read_rows

    return [row["_id"] for row in read_rows(files)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job_dir")
    parser.add_argument("--data", nargs="+", required=True, help="the job's data.train_files")
    parser.add_argument("--eta", type=int, required=True, help="the job's buffer.max_staleness")
    parser.add_argument("--hostile", nargs="*", default=[], help="generator ids whose groups must not be trained")
    parser.add_argument("--window", type=int, default=20, help="steps averaged for the reward before and after")
    parser.add_argument("--mlflow", default=None, help="the tracking URI the generators reported into")
    parser.add_argument("--generators", nargs="*", default=[], help="generator ids whose last version to check "
                                                                   "(with --mlflow)")
    args = parser.parse_args(argv)
    if args.generators and not args.mlflow:
        parser.error("--generators needs --mlflow: their versions are read from it")
    finals = generator_final_versions(args.mlflow, args.generators) if args.generators else None
    report = check_history(read_jsonl(os.path.join(args.job_dir, "trained_groups.jsonl")),
                           read_jsonl(os.path.join(args.job_dir, "progress.jsonl")), data_prompt_ids(args.data),
                           args.eta, args.hostile, window=args.window, final_versions=finals,
                           generators=args.generators)
    problems = report.problems()
    print(f"{report.steps} steps over {len(report.lives)} learner lives {report.lives}, {report.groups} groups, "
          f"{report.epochs} epochs dealt; reward {report.reward_before} -> {report.reward_after}")
    print("\n".join(problems) if problems else "the history holds")
    print(json.dumps({"bench": "soak_history", "ok": not problems, "problems": problems, **asdict(report)}))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
