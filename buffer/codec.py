"""msgpack wire codec for `Group` (docs/architecture.md §3).

Groups arrive from generators we do not fully trust (other hosts, other versions, bugs), so `decode_group`
checks everything before the learner sees it and turns every failure, whatever the input bytes, into one
`CodecError` whose `reason` becomes the metric key `buffer/rejected/<reason>`. A bad group is rejected whole;
it never kills the process and never reaches a batch.

With the job's `JobLimits` (plausibility.py) it also checks the group against what this job's generators can
produce (sample count, lengths, sampling settings, reward range, the logprob floor), the counts and lengths before
any sample is decoded. A group whose only fault is tokens from weights newer than the learner's is reported last,
as `future_version`, so a backend can tell "sampled by weights a restart discarded" from a malformed group.

Arrays travel as raw little-endian `bin` with the dtype fixed per field. There is deliberately no pickle and
no msgpack-numpy anywhere: msgpack-numpy's object arrays run `pickle.loads` on wire data.
"""
from __future__ import annotations

import math

import msgpack
import numpy as np

from asyncrl.buffer.group import FINISH_REASONS, SCHEMA_VERSION, Group, Sample, Sampling, route_dtype
from asyncrl.buffer.plausibility import Implausible, JobLimits, check_shape, check_values

REJECT_REASONS = ("too_large", "malformed", "schema", "length_mismatch", "token_out_of_range", "bad_logprob",
                  "bad_version", "bad_reward", "bad_finish_reason", "empty", "group_size", "too_long", "sampling",
                  "future_version", "generator_id", "unknown_deal", "bad_route")
"""Every `CodecError.reason`; each is a metric key suffix under `buffer/rejected/`."""

_GROUP_KEYS = frozenset(
    {"schema", "group_id", "prompt_id", "generator_id", "prompt_ids", "samples", "sampling", "created_at", "meta"}
)
_SAMPLE_KEYS = frozenset({"completion_ids", "logprobs", "versions", "loss_mask", "reward", "reward_info",
                          "finish_reason"})
_TURN_SAMPLE_KEYS = _SAMPLE_KEYS | {"episode"}
"""A per-turn sample (rollout.turn_samples=per_turn) also names its episode; the key is absent otherwise, so
whole-episode groups are byte-identical to what they were."""
ROUTES_KEY = "routed_experts"
"""A sample of a job that replays MoE routes (learner.moe_routing_replay) also carries them, raw bytes in
`route_dtype`; the key is absent otherwise."""
_SAMPLING_KEYS = frozenset({"temperature", "top_p", "top_k", "max_tokens"})


class CodecError(ValueError):
    """A message that is not a valid Group. `reason` is a REJECT_REASONS slug; `field` is the wire path."""

    def __init__(self, reason: str, field: str, detail: str):
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason {reason!r}")
        super().__init__(f"{field}: {detail} [{reason}]")
        self.reason = reason
        self.field = field


def encode_group(group: Group) -> bytes:
    """One msgpack map with exactly the keys of docs/architecture.md §3, always written as SCHEMA_VERSION.

    Arrays are cast to their wire dtype with `same_kind` casting, so int64 token ids are fine but float
    token ids raise TypeError (a producer bug, not wire input).
    """
    sp = group.sampling
    wire = {
        "schema": SCHEMA_VERSION,
        "group_id": group.group_id,
        "prompt_id": group.prompt_id,
        "generator_id": group.generator_id,
        "prompt_ids": _array_to_wire(group.prompt_ids, np.int32),
        "samples": [_sample_to_wire(s) for s in group.samples],
        "sampling": {"temperature": float(sp.temperature), "top_p": float(sp.top_p), "top_k": int(sp.top_k),
                     "max_tokens": int(sp.max_tokens)},
        "created_at": float(group.created_at),
        "meta": {k: _scalar_to_wire(v) for k, v in group.meta.items()},
    }
    return msgpack.packb(wire, use_bin_type=True)


def _sample_to_wire(sample: Sample) -> dict:
    return {
        "completion_ids": _array_to_wire(sample.completion_ids, np.int32),
        "logprobs": _array_to_wire(sample.logprobs, np.float32),
        "versions": _array_to_wire(sample.versions, np.int32),
        "loss_mask": None if sample.loss_mask is None else _array_to_wire(sample.loss_mask, np.uint8),
        "reward": float(sample.reward),
        "reward_info": {k: float(v) for k, v in sample.reward_info.items()},
        "finish_reason": sample.finish_reason,
        **({} if sample.episode is None else {"episode": int(sample.episode)}),
        **({} if sample.routed_experts is None else {ROUTES_KEY: _routes_to_wire(sample.routed_experts)}),
    }


def _routes_to_wire(routes: np.ndarray) -> bytes:
    """Raw bytes in the array's own dtype, which must be a route dtype (uint8 or uint16, `route_dtype`)."""
    if routes.dtype not in (np.uint8, np.uint16) or routes.ndim != 3:
        raise TypeError(f"routed_experts must be uint8 or uint16 [positions, layers, top_k], got {routes.dtype} "
                        f"{routes.shape}")
    return _array_to_wire(routes, routes.dtype)


def _array_to_wire(values, dtype) -> bytes:
    arr = np.asarray(values)
    if arr.size == 0:  # np.asarray([]) is float64, which would fail the int cast below
        return b""
    wire = np.dtype(dtype).newbyteorder("<")
    if arr.dtype == wire:  # the usual case: already the wire dtype, so skip the cast's extra copy
        return arr.tobytes()
    return arr.astype(wire, casting="same_kind").tobytes()


def _scalar_to_wire(value):
    # numpy scalars (np.int64 is not an int subclass) become Python scalars msgpack can pack
    return value.item() if isinstance(value, np.generic) else value


def decode_group(data: bytes, *, vocab_size: int, max_version: int, max_message_bytes: int,
                 limits: JobLimits | None = None, logprob_tolerance: float = 1e-3) -> Group:
    """Validate `data` fully and return the Group, or raise CodecError (and nothing else) for any input.

    Checked in order: size (before unpacking), msgpack well-formedness, schema version, with `limits` the counts
    and lengths (before any sample is decoded), then every field's type, dtype and length, the values (token
    range, logprobs, negative versions, rewards, finish reasons), with `limits` the sampling, reward range and
    logprob floor, and last versions above `max_version` (`future_version`).
    Returned arrays are fresh, writable, native-endian copies (int32 / float32 / uint8), not views of `data`.
    """
    root = _unpack(data, max_message_bytes, limits)
    # structure and types first, so a value check never runs on a half-parsed group
    if type(root) is not dict:
        raise CodecError("malformed", "group", f"expected a map, got {type(root).__name__}")
    _check_schema(root.get("schema"))
    _check_keys(root, _GROUP_KEYS, "group")
    if limits is not None:
        _plausible(check_shape, root, limits)
    group_id = _identifier(root["group_id"], "group_id")
    if not group_id:
        raise CodecError("malformed", "group_id", "must be non-empty")
    prompt_ids = _array(root["prompt_ids"], "prompt_ids", np.int32)
    group = Group(
        group_id=group_id,
        prompt_id=_identifier(root["prompt_id"], "prompt_id"),
        generator_id=_identifier(root["generator_id"], "generator_id"),
        prompt_ids=prompt_ids,
        samples=_samples(root["samples"]),
        sampling=_sampling(root["sampling"]),
        created_at=_finite_float(root["created_at"], "created_at"),
        meta=_meta(root["meta"]),
    )
    _check_tokens(prompt_ids, "prompt_ids", vocab_size)
    _check_episodes(group.samples)
    _decode_routes(root["samples"], group, None if limits is None else limits.routing)
    newest = -1
    for i, sample in enumerate(group.samples):
        _check_sample_values(sample, f"samples[{i}]", vocab_size, logprob_tolerance)
        if len(sample.versions):
            newest = max(newest, int(sample.versions.max()))
    if limits is not None:
        _plausible(check_values, group, limits)
    if newest > max_version:  # last: everything else is valid, so a backend may drop rather than reject it
        raise CodecError("future_version", "samples[].versions", f"version {newest} is newer than the learner's "
                                                                 f"{max_version}")
    return group


def _decode_routes(wire_samples: list, group: Group, routing: tuple | None) -> None:
    """Each sample's routed experts, checked against the model's (num_layers, top_k, num_experts): present exactly
    when the job replays routes, one row per position the sampler ran through the model (P + T - 1: the prompt's
    and the completion's but the last token), every index an expert of the model. A route the learner replayed
    unchecked would index past the experts or send a token to experts it never went to."""
    for i, (wire, sample) in enumerate(zip(wire_samples, group.samples)):
        where = f"samples[{i}].{ROUTES_KEY}"
        raw = wire.get(ROUTES_KEY)
        if routing is None:
            if raw is not None:
                raise CodecError("malformed", where, "routed experts, but this job does not replay routes "
                                                     "(learner.moe_routing_replay is off)")
            continue
        if raw is None:
            raise CodecError("bad_route", where, "missing: this job replays routes (learner.moe_routing_replay), "
                                                 "so every sample carries them")
        if type(raw) is not bytes:
            raise CodecError("malformed", where, f"expected bytes, got {type(raw).__name__}")
        layers, top_k, experts = routing
        dtype = route_dtype(experts)
        rows = len(group.prompt_ids) + len(sample.completion_ids) - 1
        if len(raw) != rows * layers * top_k * dtype.itemsize:
            raise CodecError("bad_route", where, f"{len(raw)} bytes, not [{rows} positions, {layers} layers, "
                                                 f"{top_k} experts] of {dtype.name}")
        routes = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(rows, layers, top_k)
        if routes.size and int(routes.max()) >= experts:
            raise CodecError("bad_route", where, f"expert {int(routes.max())} of a model with {experts}")
        sample.routed_experts = routes


def _check_episodes(samples: list) -> None:
    """Per-turn samples (`episode` set) are all or nothing in a group, and name episodes 0, 1, ... each with at
    least one turn: the learner gives every turn of an episode that episode's advantage."""
    named = [s.episode for s in samples if s.episode is not None]
    if not named:
        return
    if len(named) != len(samples):
        raise CodecError("malformed", "samples[].episode", f"{len(named)} of {len(samples)} samples name an episode: "
                                                           f"a group's samples are all per-turn or none are")
    episodes = set(named)
    if episodes != set(range(len(episodes))):
        raise CodecError("malformed", "samples[].episode", f"episodes {sorted(episodes)[:8]} are not 0 .. "
                                                           f"{len(episodes) - 1}, each with a turn")


def _plausible(check, value, limits: JobLimits) -> None:
    try:
        check(value, limits)
    except Implausible as err:
        raise CodecError(err.reason, err.field, err.detail) from None


MAX_ID_CHARS = 1024
"""group_id, prompt_id and generator_id are keys (Redis marks, the audit trail, log lines), not payloads: a uuid4 hex
is 32 characters and a prompt id `<file name>:<row>`; a 10 MB id would otherwise be written into every one of them."""


def _identifier(value, field: str) -> str:
    value = _exact(value, field, str)
    if len(value) > MAX_ID_CHARS:
        raise CodecError("malformed", field, f"{len(value)} characters > {MAX_ID_CHARS}")
    return value


def _unpack(data, max_message_bytes: int, limits: JobLimits | None = None):
    """The msgpack structure. The only array a group holds is `samples`, so with the job's limits known, one longer
    than a group can be (rollout.n, times rollout.max_turns with per-turn samples) is refused by msgpack as it
    reads the header (87k one-token samples otherwise take 0.3 s to unpack only to be rejected)."""
    group_size = None if limits is None else limits.max_samples
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError("malformed", "message", f"expected bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > max_message_bytes:
        raise CodecError("too_large", "message", f"{size} bytes exceeds max_message_bytes={max_message_bytes}")
    try:
        # Explicit limits so a short header cannot claim a huge container; ext types are never valid here.
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_message_bytes,
            max_str_len=max_message_bytes,
            max_array_len=max_message_bytes if group_size is None else group_size,
            max_map_len=max_message_bytes // 2,
            max_ext_len=0,
        )
    except ValueError as e:
        if group_size is not None and "max_array_len" in str(e):
            turns = f" x rollout.max_turns={limits.max_turns}" if limits.max_turns > 1 else ""
            raise CodecError("group_size", "message", f"an array longer than rollout.n={limits.group_size}{turns} "
                                                      f"(a group's only array is its samples)") from None
        raise CodecError("malformed", "message", f"not valid msgpack ({type(e).__name__}: {str(e)[:200]})") from None
    except Exception as e:  # msgpack raises many types (ExtraData, StackError, UnicodeDecodeError, ...)
        raise CodecError("malformed", "message", f"not valid msgpack ({type(e).__name__}: {str(e)[:200]})") from None


def _check_schema(schema) -> None:
    if type(schema) is not int:
        raise CodecError("malformed", "schema", "missing or not an int")
    if schema != SCHEMA_VERSION:
        raise CodecError("schema", "schema", f"unknown version {schema}; this decoder knows {SCHEMA_VERSION}")


def _check_keys(obj, expected: frozenset, field: str) -> None:
    if type(obj) is not dict:
        raise CodecError("malformed", field, f"expected a map, got {type(obj).__name__}")
    if obj.keys() != expected:
        missing = sorted(expected - obj.keys())
        extra = sorted(repr(k) for k in obj.keys() - expected)  # keys may mix str and bytes
        raise CodecError("malformed", field, f"missing keys {missing}, unexpected keys {extra}")


def _samples(value) -> list[Sample]:
    if type(value) is not list:
        raise CodecError("malformed", "samples", f"expected an array, got {type(value).__name__}")
    if not value:
        raise CodecError("empty", "samples", "a group needs at least one sample")
    return [_sample(s, f"samples[{i}]") for i, s in enumerate(value)]


def _sample(obj, where: str) -> Sample:
    """Types and dtypes only; values are checked by `_check_sample_values` once the whole group parsed."""
    expected = _TURN_SAMPLE_KEYS if type(obj) is dict and "episode" in obj else _SAMPLE_KEYS
    _check_keys(obj, expected | {ROUTES_KEY} if type(obj) is dict and ROUTES_KEY in obj else expected, where)
    return Sample(
        completion_ids=_array(obj["completion_ids"], f"{where}.completion_ids", np.int32),
        logprobs=_array(obj["logprobs"], f"{where}.logprobs", np.float32),
        versions=_array(obj["versions"], f"{where}.versions", np.int32),
        reward=_float(obj["reward"], f"{where}.reward"),
        finish_reason=_exact(obj["finish_reason"], f"{where}.finish_reason", str),
        loss_mask=None if obj["loss_mask"] is None else _array(obj["loss_mask"], f"{where}.loss_mask", np.uint8),
        reward_info=_reward_info(obj["reward_info"], f"{where}.reward_info"),
        episode=_exact(obj["episode"], f"{where}.episode", int) if "episode" in obj else None,
    )


def _check_sample_values(s: Sample, where: str, vocab_size: int, logprob_tolerance: float):
    n = len(s.completion_ids)
    for name, arr in (("logprobs", s.logprobs), ("versions", s.versions), ("loss_mask", s.loss_mask)):
        if arr is not None and len(arr) != n:
            raise CodecError("length_mismatch", f"{where}.{name}", f"length {len(arr)} != completion_ids {n}")
    _check_tokens(s.completion_ids, f"{where}.completion_ids", vocab_size)
    _check_logprobs(s.logprobs, f"{where}.logprobs", logprob_tolerance)
    bad = s.versions < 0
    if bad.any():
        i = _first(bad)
        raise CodecError("bad_version", f"{where}.versions", f"[{i}]={s.versions[i]} is negative")
    # loss_mask is a boolean on the wire; any other byte would silently scale the loss
    if s.loss_mask is not None and np.any(s.loss_mask > 1):
        raise CodecError("malformed", f"{where}.loss_mask", "values must be 0 or 1")
    if not math.isfinite(s.reward):
        raise CodecError("bad_reward", f"{where}.reward", f"must be finite, got {s.reward}")
    for key, v in s.reward_info.items():
        if not math.isfinite(v):
            raise CodecError("bad_reward", f"{where}.reward_info[{key!r}]", f"must be finite, got {v}")
    if s.finish_reason not in FINISH_REASONS:
        raise CodecError("bad_finish_reason", f"{where}.finish_reason", f"{s.finish_reason!r} not in {FINISH_REASONS}")


def _check_tokens(ids: np.ndarray, field: str, vocab_size: int) -> None:
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        i = _first(bad)
        raise CodecError("token_out_of_range", field, f"[{i}]={ids[i]} not in [0, {vocab_size})")


def _check_logprobs(logprobs: np.ndarray, field: str, tolerance: float) -> None:
    bad = ~np.isfinite(logprobs) | (logprobs > tolerance)
    if bad.any():
        i = _first(bad)
        raise CodecError("bad_logprob", field, f"[{i}]={logprobs[i]} must be finite and <= 0 (tol {tolerance})")


def _first(bad: np.ndarray) -> int:
    """Index of the first True. Checks test `bad.any()` first and call this only to name the culprit: the
    `flatnonzero` it costs, run on every array of every valid group, was a fifth of decoding one."""
    return int(np.flatnonzero(bad)[0])


def _sampling(obj) -> Sampling:
    _check_keys(obj, _SAMPLING_KEYS, "sampling")
    return Sampling(
        temperature=_finite_float(obj["temperature"], "sampling.temperature"),
        top_p=_finite_float(obj["top_p"], "sampling.top_p"),
        top_k=_exact(obj["top_k"], "sampling.top_k", int),
        max_tokens=_exact(obj["max_tokens"], "sampling.max_tokens", int),
    )


def _meta(obj) -> dict[str, str | int | float]:
    _check_str_keyed_map(obj, "meta")
    for key, v in obj.items():
        if type(v) not in (str, int, float):  # bool, nil, bin, containers are not meta scalars
            raise CodecError("malformed", f"meta[{key!r}]", f"expected str, int or float, got {type(v).__name__}")
        if type(v) is float and not math.isfinite(v):
            raise CodecError("malformed", f"meta[{key!r}]", f"must be finite, got {v}")
    return dict(obj)


def _reward_info(obj, field: str) -> dict[str, float]:
    _check_str_keyed_map(obj, field)
    return {key: _float(v, f"{field}[{key!r}]") for key, v in obj.items()}


def _check_str_keyed_map(obj, field: str) -> None:
    if type(obj) is not dict:
        raise CodecError("malformed", field, f"expected a map, got {type(obj).__name__}")
    for key in obj:
        if type(key) is not str:
            raise CodecError("malformed", field, f"key {key!r} is not a str")


_WIRE_DTYPES = {np.dtype(t): np.dtype(t).newbyteorder("<") for t in (np.int32, np.float32, np.uint8)}
"""Native dtype -> its little-endian wire dtype, built once rather than per array."""


def _array(value, field: str, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if type(value) is not bytes:
        raise CodecError("malformed", field, f"expected bin, got {type(value).__name__}")
    if len(value) % dtype.itemsize:
        raise CodecError("malformed", field, f"{len(value)} bytes is not a whole number of {dtype.name}")
    return np.frombuffer(value, dtype=_WIRE_DTYPES[dtype]).astype(dtype)


def _exact(value, field: str, kind: type):
    if type(value) is not kind:  # exact type: msgpack's true/false arrive as bool, which must not pass as int
        raise CodecError("malformed", field, f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _float(value, field: str) -> float:
    """Ints are accepted too: other producers may pack a whole-valued float as an int."""
    if type(value) not in (int, float):
        raise CodecError("malformed", field, f"expected float, got {type(value).__name__}")
    return float(value)


def _finite_float(value, field: str) -> float:
    f = _float(value, field)
    if not math.isfinite(f):
        raise CodecError("malformed", field, f"must be finite, got {f}")
    return f
