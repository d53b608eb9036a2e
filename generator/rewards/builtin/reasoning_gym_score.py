"""Prompts from the `reasoning-gym` package (data.source=reasoning_gym), and their scoring by its own verifiers.

reasoning-gym generates reasoning tasks procedurally (arithmetic, logic, puzzles, graphs, ...) with a verifier
per task, so a job needs no dataset download and no scorer of ours. Rows are built the same on every generator
(the task's generator seeded from job.seed), each carrying its reasoning-gym entry in `extra_info["entry"]`:
the verifier needs the entry's metadata, not only the answer. The completion's answer is the content of its last
<answer>...</answer>, or, without one, its last non-empty line.
"""
import re

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
INSTRUCTION = "Think it through, then give only the final answer inside <answer></answer>."
PREFIX = "reasoning_gym/"


def import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise RuntimeError("data.source=reasoning_gym needs the reasoning-gym package: pip install "
                           "'asyncrl[reasoning]' (or reasoning-gym==0.1.25)") from None
    return reasoning_gym


def reasoning_gym_rows(tasks: list, size: int, seed: int) -> list[dict]:
    """`size` rows per task in verl's row format (what generator/dataset.read_rows returns)."""
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


def final_answer(text: str) -> str | None:
    tagged = ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    entry = (extra_info or {}).get("entry") if isinstance(extra_info, dict) else None
    if not isinstance(entry, dict):
        raise ValueError(f"{data_source}: the row carries no reasoning-gym entry in extra_info['entry']")
    verify = import_reasoning_gym().get_score_answer_fn(data_source[len(PREFIX):])
    answer = final_answer(str(solution_str))
    return {"score": float(verify(answer, entry)), "answer_found": float(answer is not None)}
