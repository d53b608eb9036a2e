"""The neutral judge of bench/time_to_reward.py: one evaluator for every run's final model, whoever trained it.

The sampled reward each framework logs while it trains is not the judge: it is measured on training prompts, at the
trainer's own temperature, by the trainer's own code. The judge scores a final model (an HF model directory: TRL's
`<job dir>/final`; or an asyncrl learner checkpoint, which `asyncrl eval` exports first) on the task's held-out
split (SuiteTask.test_files, none of it trained on) with `asyncrl eval` (launch/evaluate.py), run twice:
- greedy (eval.n = 1, T = 0): mean reward and the exact rate (pass@1: the reward reaches eval.pass_threshold);
- T = 1 (eval.n = n samples per prompt): mean reward and pass@k for each k (the unbiased estimator,
  telemetry/eval_metrics.py).
Both runs read the task's recipe and overrides (its reward, its rollout.max_tokens, its pass threshold) and then
JUDGE_ENGINE, so every model is decoded by the same engine with the same settings, whatever its trainer sampled
with: the batched `hf` engine (transformers' forward pass, fp32 on CPU). Why `hf` and not vLLM: it is the engine
both frameworks' CPU runs sample with (TRL's HF `generate` and asyncrl's recipes), it needs no minute-long engine
start per model, and it has no prefix cache or batch-size-dependent kernels whose numerics could tell two models
apart by anything but their weights.

A multi-turn task (tools, an environment, an agent) is judged on whole episodes: `asyncrl eval` plays each held-out
prompt through the same episode runner a generator uses and scores each episode as training does
(generator/evaluation.py), so a model that calls the tool is scored on its answer after the result, not on its call;
the judge then also reports the share of episodes that called a tool.
Usage:
    python -m asyncrl.bench.judge --task NAME --model DIR [--root DIR] [--n 8] [--ks 1 4 8] [--max-prompts N]
        [overrides...]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

JUDGE_ENGINE = ("generator.engine=hf", "generator.torch_threads=2")
"""The one engine and thread count every model is judged with (the judge runs alone, between runs)."""


def eval_settings(temperature: float, n: int, ks: tuple) -> list:
    """The eval.* overrides of one of the judge's two runs."""
    return [f"eval.n={n}", f"eval.temperature={temperature}", f"eval.k_values=[{','.join(str(k) for k in ks)}]"]


def eval_command(model_dir: str, task, files: list, settings: list, overrides: tuple = ()) -> list:
    """`asyncrl eval` on `files` with the task's recipe and overrides, the caller's, then the judge's own: the
    judge's come last, so no task or run can change the engine it is judged with. The files come after every
    override (`--files` takes what follows it)."""
    return [sys.executable, "-m", "asyncrl.launch.cli", "eval", "--config", task.recipe, *task.overrides, *overrides,
            *JUDGE_ENGINE, *settings, "--checkpoint", model_dir, "--files", *files]


def parse_eval_output(stdout: str) -> dict:
    """The metrics of `asyncrl eval`'s output: its last line that is a JSON object (the table and the progress
    lines come before it)."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"asyncrl eval's last JSON line does not parse ({err}): {line[:200]!r}") from None
    raise ValueError(f"asyncrl eval printed no JSON line; its output ended with: {stdout[-500:]!r}")


def scores_from(greedy: dict, sampled: dict, ks: tuple) -> dict:
    """The judge's numbers from the two runs' metrics (over all prompts, `eval/all/...`)."""
    scores = {"prompts": int(greedy["eval/all/prompts"]),
              "greedy_reward": greedy["eval/all/mean_reward"], "greedy_pass": greedy["eval/all/pass_at_1"],
              "t1_reward": sampled["eval/all/mean_reward"],
              **{f"pass_at_{k}": sampled[f"eval/all/pass_at_{k}"] for k in ks}}
    if "eval/all/tool_use" in sampled:  # episodes: the share of them (at T = 1) that called a tool
        scores["t1_tool_use"] = sampled["eval/all/tool_use"]
    return scores


def first_rows(files: tuple, count: int, workdir: str) -> list:
    """The first `count` rows of `files` in one parquet file under workdir (a tiny judge for tests)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.concat_tables([pq.read_table(path) for path in files]).slice(0, count)
    path = os.path.join(workdir, "heldout.parquet")
    pq.write_table(table, path)
    return [path]


def run_evals(commands: list) -> list:
    """Each `asyncrl eval` command's metrics, the commands run side by side (most of each is its start-up: Python,
    torch, the model; the decoding is a few seconds), so judging a model costs one start-up's wall time."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for command in commands]
    outputs = [proc.communicate() for proc in procs]
    for command, proc, (stdout, stderr) in zip(commands, procs, outputs):
        if proc.returncode != 0:
            raise RuntimeError(f"the judge's asyncrl eval failed ({proc.returncode}): {' '.join(command)}\n"
                               f"{stdout[-2000:]}\n{stderr[-3000:]}")
    return [parse_eval_output(stdout) for stdout, _ in outputs]


def judge(model_dir: str, task, n: int = 8, ks=(1, 4, 8), overrides: tuple = (), max_prompts: int = 0) -> dict:
    """Scores of the model in `model_dir` (an HF model dir or an asyncrl checkpoint) on task.test_files: greedy and
    at T = 1 (n samples, pass@k for k in ks; episodes on a multi-turn task). `overrides` go to both runs after the
    task's (e.g. demo.* settings of the run being judged); max_prompts > 0 judges only the first that many held-out
    prompts."""
    ks = tuple(k for k in ks if k <= n)
    with tempfile.TemporaryDirectory(prefix="asyncrl-judge-") as workdir:
        files = first_rows(task.test_files, max_prompts, workdir) if max_prompts else list(task.test_files)
        greedy, sampled = run_evals([eval_command(model_dir, task, files, eval_settings(0.0, 1, (1,)), overrides),
                                     eval_command(model_dir, task, files, eval_settings(1.0, n, ks), overrides)])
    return scores_from(greedy, sampled, ks)


def format_scores(name: str, scores: dict) -> str:
    """A one-row markdown table of a judge's scores."""
    keys = [key for key in scores if key != "prompts"]
    return ("| model | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys) + "\n"
            f"| {name} | " + " | ".join(f"{scores[key]:.3f}" for key in keys) + " |")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, help="a task of bench/suite/tasks.py::SUITE")
    parser.add_argument("--model", required=True, help="an HF model dir or an asyncrl checkpoint (dir or root)")
    parser.add_argument("--root", default=os.path.expanduser("~/.cache/asyncrl/suite"),
                        help="where the suite's tasks are built and cached")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt at T = 1")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-prompts", type=int, default=0, help="judge only the first N held-out prompts")
    parser.add_argument("overrides", nargs="*", help="overrides after the task's (e.g. demo.* of the run)")
    args = parser.parse_args(argv)
    from asyncrl.bench.suite.tasks import build_task

    task = build_task(args.task, args.root)
    scores = judge(args.model, task, args.n, tuple(args.ks), tuple(args.overrides), args.max_prompts)
    print(f"judge: {task.name} on {', '.join(task.test_files)}, engine {' '.join(JUDGE_ENGINE)}")
    print(format_scores(args.model, scores))
    result = {"bench": "judge", "task": task.name, "model": args.model, **scores}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
