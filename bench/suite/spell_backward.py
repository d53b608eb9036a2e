"""spell_backward, the suite's reasoning-gym task: reasoning-gym's `spell_backward` generator (English words of
3-8 letters), scored by reasoning-gym's own verifier (rewards/spell_backward.py, partial credit per leading letter
right).

Prompts are a compact rendering of the entry, `spell:ammonia=`, not reasoning-gym's question as is ("Spell this word
backward (example: sun -> nus): ammonia", ~50 constant characters): a ~1M-parameter character model gains nothing
from the constant text, and it would make every sequence ~4x longer, so each step ~4x dearer on 2 cores. The entry
itself travels in extra_info["entry"] (JSON) so the verifier sees what reasoning-gym generated.
"""
import json
import os

from asyncrl.bench.suite.assets import BuildSettings, build_assets, verl_row
from asyncrl.bench.suite.task import SuiteTask

NAME = "spell_backward"
REWARD_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rewards", "spell_backward.py")
MIN_WORD_LEN, MAX_WORD_LEN = 3, 8


def make_splits(num_train: int, num_sft: int, num_test: int, seed: int) -> dict:
    """Entries from reasoning-gym's generator (seeded), one per distinct word; the held-out words are taken first,
    so no training row has a test word."""
    import reasoning_gym

    wanted = num_test + num_train + num_sft
    dataset = reasoning_gym.create_dataset(NAME, size=3 * wanted, seed=seed, min_word_len=MIN_WORD_LEN,
                                           max_word_len=MAX_WORD_LEN)
    entries, words = [], set()
    for index in range(len(dataset)):
        entry = dataset[index]
        if entry["metadata"]["word"] not in words:
            words.add(entry["metadata"]["word"])
            entries.append(entry)
        if len(entries) == wanted:
            break
    else:
        raise ValueError(f"reasoning-gym's {NAME} gave {len(entries)} distinct words, {wanted} wanted")
    cuts = {"test": entries[:num_test], "train": entries[num_test:num_test + num_train],
            "sft": entries[num_test + num_train:]}
    return {split: [verl_row(NAME, f"spell:{entry['metadata']['word']}=", entry["answer"], split, i,
                             entry=json.dumps(entry)) for i, entry in enumerate(batch)]
            for split, batch in cuts.items()}


def build(root: str, seed: int = 0, num_train: int = 4096, num_sft: int = 2048, num_test: int = 128,
          sft_steps: int = 100, sft_batch_size: int = 64, hidden: int = 128, layers: int = 4) -> SuiteTask:
    settings = BuildSettings(name=NAME, seed=seed, num_train=num_train, num_sft=num_sft, num_test=num_test,
                             hidden=hidden, layers=layers, sft_steps=sft_steps, sft_batch_size=sft_batch_size,
                             recipe={"rollout": {"max_tokens": 12}})
    paths = build_assets(root, settings, lambda: make_splits(num_train, num_sft, num_test, seed), REWARD_FILE)
    return SuiteTask(name=NAME, recipe=paths.recipe, overrides=(), test_files=(paths.test,), target=0.6,
                     steps=300, warm_start=paths.model)
