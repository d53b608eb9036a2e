"""A bit-exact delta between two versions of the same layout, for the catch-up path (pure functions).

Why: a generator on another host holds version b and needs v. Weights published in bf16 keep most elements
bit-identical from one step to the next (at RL learning rates an fp32 master weight moves by less than half a bf16
ulp), so sending only the changed elements is far cheaper than the whole version. verl reports about 1-3% of
bytes changing per step.

Each tensor's elements are compared as integers of their width, so the comparison is of bits (a NaN or -0.0 is
no special case). A tensor's changes travel in the cheapest of three encodings, two frames each:
- "gap": uint8 distances from one changed element to the next, then the new values (1 + w bytes per change);
  a distance over 255 is bridged by rewriting unchanged elements with their own bits on the way (at a few
  percent changed, a gap that long is rare);
- "idx": int32 flat indices, then the new values (4 + w bytes per change: a few changes in a huge tensor);
- "mask": a packed bitmap of changed elements (1 bit per element), then the new values (most elements changed).
Tensors with no change are left out. Past `max_fraction` of the full version's bytes the caller sends it whole.

The receiver starts from its own copy of b, applies the patches, and verifies the result against v's checksums:
a delta applied to other bytes than the server's b cannot pass, so `base_digest` lets the server refuse early.
"""
import hashlib
import json

import numpy as np
import torch

from asyncrl.weightsync.buckets import FlatBuckets

KINDS = ("gap", "idx", "mask")
MAX_GAP = 255
SAMPLE_STRIDE = 97
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaError(ValueError):
    """A delta that does not fit the layout it claims (malformed, or for another layout)."""


def base_digest(message) -> str:
    """Names the exact bytes of a version (`message`: its announcement.WeightsAnnouncement): its layout and
    per-bucket checksums (a resumed learner reuses version numbers with other bytes, so the number alone is not
    enough)."""
    payload = json.dumps([message.fingerprint, list(message.checksums)]).encode()
    return hashlib.sha256(payload).hexdigest()[:32]


def _words(buckets: FlatBuckets, entry) -> torch.Tensor:
    raw = buckets.buffers[entry.bucket][entry.offset:entry.offset + entry.nbytes]
    width = buckets.view(entry).element_size()
    return raw.view(_WORDS[width])


def encode(base: FlatBuckets, target: FlatBuckets, max_fraction: float = 0.5):
    """(entries, frames) turning `base` into `target`, or None when it would cost more than `max_fraction` of the
    full bytes, or the layouts differ. `entries`: [entry index, kind, changed count] for each changed tensor;
    `frames`: two byte tensors per entry (indices or bitmap, then values), fresh copies the caller may send."""
    layout = target.layout
    if base.layout.fingerprint != layout.fingerprint:
        return None
    budget = max_fraction * layout.total_bytes
    if _estimated_cost(base, target) > budget:  # fp32 weights, a large step: say so after reading 1% of the bytes
        return None
    entries, frames, cost = [], [], 0
    for index, entry in enumerate(layout.entries):
        new, old = _words(target, entry), _words(base, entry)
        differs = new != old
        changed = torch.nonzero(differs).reshape(-1)
        count = changed.numel()
        if count == 0:
            continue
        width = new.element_size()
        positions = changed.numpy()
        bridged = _bridged(positions)
        costs = {"gap": bridged.size * (1 + width), "idx": count * (4 + width),
                 "mask": -(-new.numel() // 8) + count * width}
        kind = min(costs, key=costs.get)
        cost += costs[kind]
        if cost > budget:
            return None
        if kind == "gap":
            changed = torch.from_numpy(bridged)
            where = torch.from_numpy(np.diff(bridged, prepend=-1).astype(np.uint8))
        elif kind == "idx":
            where = changed.to(torch.int32).view(torch.uint8)
        else:
            where = torch.from_numpy(np.packbits(differs.numpy()))
        entries.append([index, kind, changed.numel()])
        frames += [where, new[changed].view(torch.uint8)]
    return entries, frames


def _estimated_cost(base: FlatBuckets, target: FlatBuckets, stride: int = SAMPLE_STRIDE) -> float:
    """What encode would send, from every `stride`-th element (bridges left out: a lower bound, nearly)."""
    cost = 0.0
    for entry in target.layout.entries:
        new, old = _words(target, entry), _words(base, entry)
        width, numel = new.element_size(), new.numel()
        if numel == 0:
            continue
        sampled = new[::stride]
        count = int((sampled != old[::stride]).sum()) * numel / sampled.numel()
        cost += min(count * (1 + width), numel / 8 + count * width)
    return cost


def _bridged(positions: np.ndarray) -> np.ndarray:
    """`positions` (sorted) with unchanged positions added so that no two consecutive ones, nor -1 and the
    first, lie more than MAX_GAP apart."""
    gaps = np.diff(positions, prepend=-1)
    long = np.flatnonzero(gaps > MAX_GAP)  # few at a few percent changed: the work below is on these alone
    if long.size == 0:
        return positions
    fillers = (gaps[long] - 1) // MAX_GAP
    total = int(fillers.sum())
    starts = np.repeat(positions[long] - gaps[long], fillers)
    steps = np.arange(total) - np.repeat(np.cumsum(fillers) - fillers, fillers) + 1
    return np.insert(positions, np.repeat(long, fillers), starts + MAX_GAP * steps)  # each before its gap's end


def apply(dest: FlatBuckets, entries, frames) -> None:
    """Apply `encode`'s output to `dest` (which holds the base) in place. `entries` and `frames` come from another
    machine: every count, index and size is checked before a byte is written (DeltaError)."""
    layout = dest.layout
    if not isinstance(entries, list) or len(frames) != 2 * len(entries):
        raise DeltaError(f"a delta of {len(frames)} frames for {len(entries) if isinstance(entries, list) else '?'} "
                         f"tensors (two frames each)")
    for k, item in enumerate(entries):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], int) and item[1] in KINDS
                and isinstance(item[2], int)) or not 0 <= item[0] < len(layout.entries):
            raise DeltaError(f"delta entry {k} is malformed: {str(item)[:80]}")
        index, kind, count = item
        entry = layout.entries[index]
        words = _words(dest, entry)
        width, numel = words.element_size(), words.numel()
        where, values = np.frombuffer(frames[2 * k], dtype=np.uint8), np.frombuffer(frames[2 * k + 1], dtype=np.uint8)
        if not 0 < count <= numel or values.size != count * width:
            raise DeltaError(f"delta for {entry.name}: {count} changes in {values.size} value bytes; the tensor has "
                             f"{numel} elements of {width} bytes")
        values = torch.from_numpy(values.copy()).view(words.dtype)
        if kind == "gap":
            if where.size != count:
                raise DeltaError(f"delta for {entry.name}: {where.size} gaps for {count} changes")
            positions = torch.from_numpy(np.cumsum(where, dtype=np.int64) - 1)
            if int(where.min()) < 1 or int(positions[-1]) >= numel:
                raise DeltaError(f"delta for {entry.name}: gaps that repeat an element or run past its {numel}")
            words[positions] = values
        elif kind == "idx":
            if where.size != 4 * count:
                raise DeltaError(f"delta for {entry.name}: {where.size} index bytes for {count} changes")
            positions = torch.from_numpy(where.copy().view(np.int32)).long()
            if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= numel):
                raise DeltaError(f"delta for {entry.name}: an index outside its {numel} elements")
            words[positions] = values
        else:
            if where.size != -(-numel // 8):
                raise DeltaError(f"delta for {entry.name}: a bitmap of {where.size} bytes for {numel} elements")
            mask = torch.from_numpy(np.unpackbits(where, count=numel).astype(bool))
            if int(mask.sum()) != count:
                raise DeltaError(f"delta for {entry.name}: the bitmap marks {int(mask.sum())} changes, not {count}")
            words[mask] = values


def nbytes(frames) -> int:
    """Bytes a delta's frames carry (what the wire sends beyond the control message)."""
    return sum(memoryview(frame).nbytes if not isinstance(frame, torch.Tensor) else frame.numel() for frame in frames)
