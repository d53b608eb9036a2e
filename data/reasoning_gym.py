"""Prompt rows from the `reasoning-gym` package (data.source=reasoning_gym).

reasoning-gym generates reasoning tasks procedurally (arithmetic, logic, puzzles, graphs, ...) with a verifier per
task, so a job needs no dataset download. Rows are built the same in every process that builds them (the task's
generator seeded from job.seed): the learner deals them, and a generator that walks its own copy builds the same
ones. Each row carries its reasoning-gym entry in `extra_info["entry"]`, because the task's verifier needs the
entry's metadata, not only the answer (the built-in scorer reasoning_gym_score.py scores with it).
"""

INSTRUCTION = "Think it through, then give only the final answer inside <answer></answer>."
PREFIX = "reasoning_gym/"
"""Every row's data_source starts with it; the rest is the task's name, which picks the verifier."""


def import_reasoning_gym():
    """The package, imported only by jobs that use it (it is an extra: asyncrl[reasoning])."""
    try:
        import reasoning_gym
    except ImportError:
        raise RuntimeError("data.source=reasoning_gym needs the reasoning-gym package: pip install "
                           "'asyncrl[reasoning]' (or reasoning-gym==0.1.25)") from None
    return reasoning_gym


def reasoning_gym_rows(tasks: list, size: int, seed: int) -> list[dict]:
    """`size` rows per task in verl's row format (what data/prompts.py::read_rows returns)."""
    reasoning_gym = import_reasoning_gym()
    rows = []
    for task in tasks:
        try:
            dataset = reasoning_gym.create_dataset(task, size=size, seed=seed)
        except Exception as err:  # an unknown name raises inside the package's registry
            raise ValueError(f"data.reasoning_gym_tasks: reasoning-gym cannot make {task!r} ({err})") from None
        for index in range(size):
            entry = dataset[index]
            rows.append({"prompt": [{"role": "user", "content": f"{entry['question']}\n{INSTRUCTION}"}],
                         "data_source": f"{PREFIX}{task}", "reward_model": {"ground_truth": entry["answer"]},
                         "extra_info": {"entry": entry}, "_id": f"{PREFIX}{task}:{index}"})
    return rows
