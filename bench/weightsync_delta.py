"""Delta catch-up: what a generator on another host receives per version when it names the version it holds.

For each setting (model shape, published dtype, learning rate) a model takes real AdamW steps on a policy-gradient
loss (random token sequences, random advantages: the gradient's shape is a real one, its values do not matter to
how many published bits move). After each step the learner's real WeightPublisher publishes the version into its
ring and the real CatchupServer serves it; a WeightStage that is "on another host" (the ring's path hidden from
it) fetches it through catch-up holding the previous version, then the same version is fetched whole for
comparison. Printed per step: elements whose published bits changed, bytes sent as a share of a full copy, and the
time of the delta fetch (encode on the server, apply and verify on the generator) against the full fetch.

Each setting runs twice, in the same job: "on demand", the server encoding a delta when it is asked for it, and
"prepared", the server encoding the next delta as soon as a version is announced (what the learner does once a
fleet follows through catch-up). There the generator asks once it is ready, as one that hears of the version a
moment later would; `ready s` is how long after the publish that was. The first step is on demand in both: no
delta has been served yet, so nobody is known to follow.

Settings: "demo" is the CPU demo's shape (Qwen2, 128 wide, 4 layers) at the demo's learning rate; "0.5b" is
Qwen2-0.5B's shape with its 151936-token vocabulary (494M parameters) at an RL learning rate of 1e-6. The published
figure to beat is verl's: about 1-3% of bytes change per step.
"""
import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from asyncrl.bench.weightsync import rounded
from asyncrl.learner.model import QWEN2_05B_SHAPE, build_qwen2
from asyncrl.weightsync import delta
from asyncrl.weightsync.catchup import CatchupServer, fetch
from asyncrl.weightsync.buckets import FlatBuckets
from asyncrl.weightsync.dtypes import dtype_name
from asyncrl.weightsync.announcement import ShmRingPlace
from asyncrl.weightsync.layout import layout_of
from asyncrl.weightsync.publisher import WeightPublisher
from asyncrl.weightsync.receiver import WeightStage

SHAPES = {"tiny": dict(vocab=64, hidden=32, layers=1), "demo": dict(vocab=256, hidden=128, layers=4),
          "0.5b": dict(vocab=151936)}


def build(shape: str, seed: int):
    if shape == "0.5b":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(seed)
        config = Qwen2Config(vocab_size=SHAPES[shape]["vocab"], tie_word_embeddings=True, max_position_embeddings=128,
                             **QWEN2_05B_SHAPE)
        return Qwen2ForCausalLM(config)
    spec = SHAPES[shape]
    return build_qwen2(spec["vocab"], spec["hidden"], spec["layers"], eos_token_id=1, pad_token_id=0, seed=seed)


def policy_gradient_step(model, optimizer, vocab: int, generator: torch.Generator, batch: int = 2,
                         length: int = 32) -> None:
    """One AdamW step on -advantage * log p(tokens), GRPO's surrogate at ratio 1."""
    tokens = torch.randint(2, vocab, (batch, length), generator=generator)
    advantages = torch.randn(batch, generator=generator)
    logits = model(input_ids=tokens).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    loss = -(advantages[:, None] * logp).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def changed_elements(ring, base_version: int, version: int) -> tuple[int, int]:
    """(elements whose bits changed, all elements) between two versions in the learner's ring."""
    base, target = ring.buckets(ring.find(base_version)), ring.buckets(ring.find(version))
    changed = total = 0
    for entry in target.layout.entries:
        new = delta._words(target, entry)
        total += new.numel()
        changed += int((new != delta._words(base, entry)).sum())
    return changed, total


def wait_prepared(server, before: int, timeout_s: float = 600.0) -> None:
    """Until the server has encoded one more delta ahead (the request then finds it ready)."""
    deadline = time.monotonic() + timeout_s
    while server.deltas_prepared == before:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the catch-up server prepared no delta within {timeout_s} s")
        time.sleep(0.005)


def run_setting(shape: str, dtype: str, lr: float, steps: int, seed: int, workdir: str, prepare: bool) -> list[dict]:
    model = build(shape, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    specs = [(name, dtype, tuple(t.shape)) for name, t in model.state_dict().items()]
    server = CatchupServer("127.0.0.1", 0, prepare_deltas=prepare)
    publisher = WeightPublisher(os.path.join(workdir, f"ring-{shape}-{dtype}"), slots=3, bucket_bytes=64 << 20,
                                catchup=server)
    stage = WeightStage(workdir, f"remote-{shape}-{dtype}", catchup_timeout_s=600)
    hidden = os.path.join(workdir, "not-on-this-host")  # the generator cannot map the ring: catch-up serves it
    rows = []
    try:
        message = publisher.publish(iter(model.state_dict().items()), 0, specs)
        elsewhere = ShmRingPlace(hidden, "other", 3)
        stage.end_load(stage.stage(dataclasses.replace(message, shm=elsewhere)), ok=True)
        scratch = FlatBuckets(layout_of(message))
        for step in range(1, steps + 1):
            policy_gradient_step(model, optimizer, SHAPES[shape]["vocab"], generator)
            prepared_before = server.deltas_prepared
            message = publisher.publish(iter(model.state_dict().items()), step, specs)
            published = time.perf_counter()
            if prepare and rows and rows[-1]["delta_used"]:  # a delta was served: the server follows the fleet
                wait_prepared(server, prepared_before)
            ready_s = time.perf_counter() - published
            sent_before, deltas_before, hits_before = server.sent_bytes, server.deltas_served, server.prepared_used
            started = time.perf_counter()
            staged = stage.stage(dataclasses.replace(message, shm=elsewhere))
            delta_s = time.perf_counter() - started
            stage.end_load(staged, ok=True)
            sent = server.sent_bytes - sent_before
            started = time.perf_counter()
            fetch(server.address, step, lambda m: scratch, 600)
            full_s = time.perf_counter() - started
            changed, total = changed_elements(publisher.ring, step - 1, step)
            rows.append({"model": shape, "dtype": dtype, "lr": lr, "mode": "prepared" if prepare else "on demand",
                         "step": step, "changed_frac": changed / total, "bytes_frac": sent / message.nbytes,
                         "delta_used": server.deltas_served > deltas_before,
                         "prepared_hit": server.prepared_used > hits_before, "ready_s": ready_s, "delta_s": delta_s,
                         "full_s": full_s, "full_bytes": message.nbytes})
            print_row(rows[-1])
    finally:
        stage.close()
        publisher.close()
    return rows


HEADER = (f"{'model':>5} {'dtype':>8} {'lr':>7} {'mode':>9} {'step':>4} {'changed %':>9} {'bytes sent %':>12} "
          f"{'ready s':>7} {'delta fetch s':>13} {'full fetch s':>12}")


def print_row(row: dict) -> None:
    print(f"{row['model']:>5} {row['dtype']:>8} {row['lr']:>7.0e} {row['mode']:>9} {row['step']:>4} "
          f"{100 * row['changed_frac']:>9.2f} {100 * row['bytes_frac']:>12.2f} {row['ready_s']:>7.3f} "
          f"{row['delta_s']:>13.3f} {row['full_s']:>12.3f}", flush=True)


def summarise(rows: list[dict]) -> dict:
    """Per setting and mode: medians over the steps (the first step included: AdamW's first update is its largest;
    it is on demand in both modes)."""
    out = {}
    for key in dict.fromkeys((r["model"], r["dtype"], r["lr"], r["mode"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["dtype"], r["lr"], r["mode"]) == key]
        out[f"{key[0]}/{key[1]}/lr={key[2]:g}/{key[3]}"] = {
            "full_mb": mine[0]["full_bytes"] / 2**20,
            "changed_frac": statistics.median(r["changed_frac"] for r in mine),
            "bytes_frac": statistics.median(r["bytes_frac"] for r in mine),
            "delta_s": statistics.median(r["delta_s"] for r in mine),
            "full_s": statistics.median(r["full_s"] for r in mine),
            "deltas_used": sum(r["delta_used"] for r in mine), "prepared_hits": sum(r["prepared_hit"] for r in mine),
            "steps": len(mine)}
    return out


def parse_setting(text: str) -> tuple[str, str, float]:
    shape, dtype, lr = text.split(":")
    if shape not in SHAPES:
        raise argparse.ArgumentTypeError(f"model {shape!r}: one of {sorted(SHAPES)}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise argparse.ArgumentTypeError(f"dtype {dtype!r}: float32, bfloat16 or float16")
    return shape, dtype_name(getattr(torch, dtype)), float(lr)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", type=parse_setting,
                        default=[parse_setting(s) for s in ("demo:float32:1e-4", "demo:bfloat16:1e-4",
                                                             "0.5b:bfloat16:1e-6")],
                        help="model:dtype:lr, model one of tiny, demo, 0.5b")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (versions) per setting")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="asyncrl-delta-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    print(HEADER)
    rows = []
    try:
        for shape, dtype, lr in args.settings:
            for prepare in (False, True):
                rows += run_setting(shape, dtype, lr, args.steps, args.seed, workdir, prepare)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarise(rows)
    print()
    for name, figures in summary.items():
        print(f"{name}: {100 * figures['changed_frac']:.2f}% of elements changed, {100 * figures['bytes_frac']:.2f}% "
              f"of {figures['full_mb']:.1f} MiB sent, {figures['delta_s']:.3f} s against {figures['full_s']:.3f} s "
              f"whole")
    print(json.dumps(rounded({"bench": "weightsync_delta", "settings": summary})))
    return summary


if __name__ == "__main__":
    main()
