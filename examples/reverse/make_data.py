"""Write a string-reversal task as verl-format parquet: train.parquet (RL prompts), sft.parquet (warm-start rows),
test.parquet (held out: none of its strings is in the other two).

    python make_data.py --out data

A row is what verl and asyncrl read: `prompt` (chat messages), `data_source` (names the task in metrics),
`reward_model.ground_truth` (what reward.py compares against) and `extra_info`.
"""
import argparse
import os
import random
import string

import pyarrow as pa
import pyarrow.parquet as pq


def words(count: int, rng: random.Random, taken: set) -> list:
    out = []
    while len(out) < count:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
        if word not in taken:
            taken.add(word)
            out.append(word)
    return out


def rows(batch: list, split: str) -> list:
    return [{"data_source": "reverse", "prompt": [{"role": "user", "content": f"rev:{word}="}],
             "reward_model": {"style": "rule", "ground_truth": word[::-1]},
             "extra_info": {"split": split, "index": i}} for i, word in enumerate(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng, taken = random.Random(args.seed), set()
    test = words(200, rng, taken)  # drawn first, so neither training split can contain them
    splits = {"test": test, "train": words(4096, rng, taken), "sft": words(2048, rng, taken)}
    os.makedirs(args.out, exist_ok=True)
    for split, batch in splits.items():
        pq.write_table(pa.Table.from_pylist(rows(batch, split)), os.path.join(args.out, f"{split}.parquet"))
        print(f"{args.out}/{split}.parquet: {len(batch)} rows")


if __name__ == "__main__":
    main()
