"""Wire codec for Group (docs/architecture.md §3): round trips, one test per reject reason, and fuzzing.

The fuzz tests pin the promise the learner relies on: for ANY bytes, `decode_group` returns a Group or raises
CodecError, never anything else.
"""
import math

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.buffer.codec import REJECT_REASONS, CodecError, decode_group, encode_group
from asyncrl.buffer.group import FINISH_REASONS, SCHEMA_VERSION, Group, Sample, Sampling, new_group_id
from asyncrl.buffer.plausibility import JobLimits

VOCAB = 1000
MAX_VERSION = 10
MAX_BYTES = 1 << 16
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode(data: bytes, **overrides) -> Group:
    limits = dict(vocab_size=VOCAB, max_version=MAX_VERSION, max_message_bytes=MAX_BYTES)
    return decode_group(data, **{**limits, **overrides})


def make_sample(n: int = 3, **overrides) -> Sample:
    fields = dict(
        completion_ids=np.arange(5, 5 + n, dtype=np.int32),
        logprobs=-np.linspace(0.0, 2.0, n, dtype=np.float32),
        versions=np.full(n, 2, dtype=np.int32),
        reward=1.0,
        finish_reason="stop",
    )
    return Sample(**{**fields, **overrides})


def make_group(**overrides) -> Group:
    fields = dict(
        group_id=new_group_id(),
        prompt_id="gsm8k/17",
        generator_id="gen-0",
        prompt_ids=np.array([1, 2, 3], dtype=np.int32),
        samples=[make_sample(), make_sample(2, loss_mask=np.array([1, 0], dtype=np.uint8), reward=0.0)],
        sampling=Sampling(temperature=1.0, top_p=0.9, top_k=50, max_tokens=64),
        created_at=1_700_000_000.25,
        meta={"data_source": "gsm8k", "answer_id": 7, "difficulty": 0.5},
    )
    return Group(**{**fields, **overrides})


def rewrite(group: Group, edit) -> bytes:
    """Encode, let `edit` change the raw wire map in place, re-pack: a way to build any bad message."""
    wire = msgpack.unpackb(encode_group(group), raw=False)
    edit(wire)
    return msgpack.packb(wire, use_bin_type=True)


def reject(data: bytes, **overrides) -> CodecError:
    with pytest.raises(CodecError) as info:
        decode(data, **overrides)
    return info.value


def assert_same_group(a: Group, b: Group) -> None:
    assert (a.group_id, a.prompt_id, a.generator_id) == (b.group_id, b.prompt_id, b.generator_id)
    assert (a.sampling, a.created_at, a.meta, a.schema) == (b.sampling, b.created_at, b.meta, b.schema)
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    assert len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples):
        for name in ("completion_ids", "logprobs", "versions"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
        assert (x.loss_mask is None) == (y.loss_mask is None)
        if x.loss_mask is not None:
            np.testing.assert_array_equal(x.loss_mask, y.loss_mask)
        assert (x.reward, x.reward_info, x.finish_reason) == (y.reward, y.reward_info, y.finish_reason)


# ------------------------------------------------------------------------------------------ round trip


def test_round_trip_keeps_every_field_including_loss_mask_meta_and_reward_info():
    group = make_group()
    group.samples[0].reward_info = {"format": 0.5, "correct": 1.0}
    out = decode(encode_group(group))
    assert_same_group(group, out)
    assert out.samples[0].loss_mask is None
    assert out.samples[1].loss_mask.tolist() == [1, 0]


def test_decoded_arrays_are_native_writable_copies():
    out = decode(encode_group(make_group()))
    s = out.samples[1]
    for arr, dtype in ((out.prompt_ids, np.int32), (s.completion_ids, np.int32), (s.logprobs, np.float32),
                       (s.versions, np.int32), (s.loss_mask, np.uint8)):
        assert arr.dtype == np.dtype(dtype) and arr.dtype.isnative and arr.flags.writeable


def test_wire_map_has_exactly_the_design_keys_and_little_endian_arrays():
    wire = msgpack.unpackb(encode_group(make_group()), raw=False)
    assert set(wire) == {"schema", "group_id", "prompt_id", "generator_id", "prompt_ids", "samples",
                         "sampling", "created_at", "meta"}
    assert wire["schema"] == SCHEMA_VERSION
    assert wire["prompt_ids"] == np.array([1, 2, 3], dtype="<i4").tobytes()
    assert wire["samples"][0]["loss_mask"] is None


def test_group_helpers_ignore_empty_samples_and_report_minus_one_without_tokens():
    group = make_group(samples=[make_sample(versions=np.array([4, 3, 5], dtype=np.int32)), make_sample(0)])
    assert group.min_version() == 3
    assert group.num_completion_tokens() == 3
    assert group.rewards() == [1.0, 1.0]
    assert make_group(samples=[make_sample(0)]).min_version() == -1


def test_empty_completion_round_trips():
    group = make_group(samples=[make_sample(0, finish_reason="abort")])
    assert decode(encode_group(group)).samples[0].completion_ids.shape == (0,)


# ------------------------------------------------------------------------------ one test per reason


def test_oversized_message_is_rejected_as_too_large_before_unpacking():
    err = reject(b"\xc1" * 100, max_message_bytes=10)  # 0xc1 is never valid msgpack: size must win
    assert err.reason == "too_large" and "max_message_bytes" in str(err)


def test_non_msgpack_bytes_are_rejected_as_malformed():
    err = reject(b"\xc1")
    assert err.reason == "malformed" and "message" in str(err)


def test_missing_key_is_rejected_as_malformed_naming_the_key():
    err = reject(rewrite(make_group(), lambda w: w.pop("prompt_id")))
    assert err.reason == "malformed" and "prompt_id" in str(err)


def test_extra_sample_key_is_rejected_as_malformed_naming_the_key():
    err = reject(rewrite(make_group(), lambda w: w["samples"][1].update(advantage=1.0)))
    assert err.reason == "malformed" and "samples[1]" in str(err) and "advantage" in str(err)


def test_wrong_python_type_is_rejected_as_malformed_naming_the_field():
    err = reject(rewrite(make_group(), lambda w: w["sampling"].update(top_k=True)))
    assert err.reason == "malformed" and err.field == "sampling.top_k"


def test_bool_meta_value_is_rejected_as_malformed():
    err = reject(rewrite(make_group(), lambda w: w["meta"].update(flag=True)))
    assert err.reason == "malformed" and "flag" in str(err)


@pytest.mark.parametrize("field", ["group_id", "prompt_id", "generator_id"])
def test_an_id_longer_than_a_key_should_be_is_malformed(field):
    """Ids become Redis keys, audit-trail entries and log text: a 10 MB one is refused, not written everywhere."""
    err = reject(rewrite(make_group(), lambda w: w.update({field: "x" * 10_000_000})), max_message_bytes=1 << 25)
    assert (err.reason, err.field) == ("malformed", field) and "10000000 characters > 1024" in str(err)
    assert decode(rewrite(make_group(), lambda w: w.update({field: "x" * 1024}))).group_id


def test_array_byte_length_not_a_multiple_of_itemsize_is_malformed():
    err = reject(rewrite(make_group(), lambda w: w["samples"][0].update(logprobs=b"\x00" * 7)))
    assert err.reason == "malformed" and err.field == "samples[0].logprobs"


def test_unknown_schema_version_is_rejected_as_schema():
    err = reject(rewrite(make_group(), lambda w: w.update(schema=SCHEMA_VERSION + 1, new_field=1)))
    assert err.reason == "schema" and "schema" in str(err)


def test_logprobs_shorter_than_completion_is_rejected_as_length_mismatch():
    group = make_group(samples=[make_sample(logprobs=np.zeros(2, dtype=np.float32))])
    err = reject(encode_group(group))
    assert err.reason == "length_mismatch" and err.field == "samples[0].logprobs"


def test_loss_mask_longer_than_completion_is_rejected_as_length_mismatch():
    group = make_group(samples=[make_sample(loss_mask=np.ones(4, dtype=np.uint8))])
    err = reject(encode_group(group))
    assert err.reason == "length_mismatch" and "loss_mask" in str(err)


@pytest.mark.parametrize("token", [-1, VOCAB])
def test_completion_token_outside_vocab_is_rejected_as_token_out_of_range(token):
    group = make_group(samples=[make_sample(completion_ids=np.array([0, token, 1], dtype=np.int32))])
    err = reject(encode_group(group))
    assert err.reason == "token_out_of_range" and err.field == "samples[0].completion_ids"


def test_prompt_token_outside_vocab_is_rejected_as_token_out_of_range():
    err = reject(encode_group(make_group(prompt_ids=np.array([1, VOCAB + 5], dtype=np.int32))))
    assert err.reason == "token_out_of_range" and err.field == "prompt_ids"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.5])
def test_nonfinite_or_positive_logprob_is_rejected_as_bad_logprob(bad):
    group = make_group(samples=[make_sample(logprobs=np.array([-0.1, bad, -1.0], dtype=np.float32))])
    err = reject(encode_group(group))
    assert err.reason == "bad_logprob" and err.field == "samples[0].logprobs"


def test_logprob_slightly_above_zero_is_within_tolerance():
    group = make_group(samples=[make_sample(logprobs=np.array([-0.1, 1e-4, 0.0], dtype=np.float32))])
    assert decode(encode_group(group)).samples[0].logprobs[1] == np.float32(1e-4)


def test_a_negative_version_is_rejected_as_bad_version():
    group = make_group(samples=[make_sample(versions=np.array([1, -1, 1], dtype=np.int32))])
    err = reject(encode_group(group))
    assert err.reason == "bad_version" and err.field == "samples[0].versions"


def test_a_version_ahead_of_the_learner_is_future_version_but_only_when_all_else_is_valid():
    """A backend drops (not rejects) a group sampled with weights a restart discarded, so the codec says
    future_version only for a group that is otherwise valid."""
    ahead = make_sample(versions=np.array([1, MAX_VERSION + 1, 1], dtype=np.int32))
    assert reject(encode_group(make_group(samples=[ahead]))).reason == "future_version"
    broken = make_group(samples=[ahead, make_sample(reward=float("nan"))])
    assert reject(encode_group(broken)).reason == "bad_reward"


def test_nan_reward_is_rejected_as_bad_reward():
    err = reject(encode_group(make_group(samples=[make_sample(reward=float("nan"))])))
    assert err.reason == "bad_reward" and err.field == "samples[0].reward"


def test_infinite_reward_info_value_is_rejected_as_bad_reward():
    err = reject(encode_group(make_group(samples=[make_sample(reward_info={"len": float("-inf")})])))
    assert err.reason == "bad_reward" and "reward_info" in str(err) and "len" in str(err)


def test_unknown_finish_reason_is_rejected_as_bad_finish_reason():
    err = reject(encode_group(make_group(samples=[make_sample(finish_reason="eos")])))
    assert err.reason == "bad_finish_reason" and err.field == "samples[0].finish_reason"


def test_group_without_samples_is_rejected_as_empty():
    err = reject(encode_group(make_group(samples=[])))
    assert err.reason == "empty" and err.field == "samples"


LIMITS = JobLimits(group_size=2, temperature=1.0, top_p=0.9, top_k=50, max_tokens=64, max_completion_tokens=64,
                   max_prompt_tokens=8, max_positions=70)
"""What make_group's generator produces: the job's limits in the plausibility tests."""


def test_a_group_that_fits_the_job_passes_its_limits():
    assert decode(encode_group(make_group()), limits=LIMITS).group_id


@pytest.mark.parametrize("overrides, reason, field", [
    (dict(samples=[make_sample()]), "group_size", "samples"),
    (dict(prompt_ids=np.array([], dtype=np.int32)), "empty", "prompt_ids"),
    (dict(prompt_ids=np.arange(1, 10, dtype=np.int32)), "too_long", "prompt_ids"),
    (dict(samples=[make_sample(65), make_sample()]), "too_long", "samples[0].completion_ids"),
    (dict(prompt_ids=np.arange(1, 9, dtype=np.int32), samples=[make_sample(63), make_sample()]), "too_long",
     "samples[0]"),
    (dict(sampling=Sampling(temperature=0.0, top_p=0.9, top_k=50, max_tokens=64)), "sampling", "sampling"),
    (dict(sampling=Sampling(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1000)), "sampling", "sampling"),
    (dict(samples=[make_sample(reward=1e300), make_sample()]), "bad_reward", "samples[0].reward"),
    (dict(samples=[make_sample(), make_sample(logprobs=np.array([-1.0, -1e38, -1.0], np.float32))]),
     "bad_logprob", "samples[1].logprobs"),
])
def test_a_group_no_generator_of_this_job_could_produce_is_rejected(overrides, reason, field):
    err = reject(encode_group(make_group(**overrides)), limits=LIMITS)
    assert (err.reason, err.field) == (reason, field), str(err)


def test_a_sample_with_no_token_that_says_it_stopped_is_implausible_beside_real_ones_or_alone():
    """An engine that stops emits its stop token: half a group of empty `stop` samples was trained (the other half
    made the group non-empty). An empty sample the engine aborted (a weight swap) is still fine."""
    for samples, field in (([make_sample(), make_sample(0)], "samples[1]"),
                           ([make_sample(0), make_sample(0)], "samples[0]")):
        err = reject(encode_group(make_group(samples=samples)), limits=LIMITS)
        assert (err.reason, err.field) == ("bad_finish_reason", field) and "stop token" in str(err)
    assert decode(encode_group(make_group(samples=[make_sample(), make_sample(0, finish_reason="abort")])),
                  limits=LIMITS).samples[1].finish_reason == "abort"


def test_the_sample_count_is_checked_before_any_sample_is_decoded():
    """87k garbage samples cost nothing: msgpack refuses an array longer than rollout.n as it reads its header, before
    building one sample (they would each fail as malformed). Without the job's limits they are unpacked."""
    data = rewrite(make_group(), lambda wire: wire.update(samples=[{"x": 1}] * 87_000))
    err = reject(data, max_message_bytes=1 << 24, limits=LIMITS)
    assert (err.reason, err.field) == ("group_size", "message") and "rollout.n=2" in str(err)
    assert reject(data, max_message_bytes=1 << 24).field == "samples[0]"


def test_every_reject_reason_has_a_test_above():
    tested = {"too_large", "malformed", "schema", "length_mismatch", "token_out_of_range", "bad_logprob",
              "bad_version", "bad_reward", "bad_finish_reason", "empty", "group_size", "too_long", "sampling",
              "future_version", "bad_route"}  # bad_route: test_routes_cross_the_wire_... below
    # generator_id and unknown_deal are a backend's checks (the group against its connection, and against the
    # prompt dealt to it): tests/unit/test_buffer_server.py
    assert set(REJECT_REASONS) == tested | {"generator_id", "unknown_deal"}


# ---------------------------------------------------------------------------------------- properties


def _decodes_or_codec_error(data: bytes) -> None:
    """With and without the job's limits: the plausibility checks run on half-parsed input too."""
    for limits in (None, LIMITS):
        try:
            out = decode(data, limits=limits)
        except CodecError as err:
            assert err.reason in REJECT_REASONS
        else:
            assert isinstance(out, Group)


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_codec_error(data):
    _decodes_or_codec_error(data)


@st.composite
def mutated_encodings(draw):
    data = bytearray(encode_group(make_group()))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            del data[at]
    return bytes(data)


@FUZZ
@given(mutated_encodings())
def test_mutated_valid_encodings_decode_or_raise_codec_error(data):
    _decodes_or_codec_error(data)


_any_wire_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@FUZZ
@given(st.sampled_from(["schema", "group_id", "prompt_ids", "samples", "sampling", "created_at", "meta",
                        "s.completion_ids", "s.logprobs", "s.versions", "s.loss_mask", "s.reward",
                        "s.reward_info", "s.finish_reason", "sampling.top_p", "sampling.max_tokens"]),
       _any_wire_value)
def test_any_value_in_any_field_decodes_or_raises_codec_error(path, value):
    def edit(wire):
        if path.startswith("s."):
            wire["samples"][0][path[2:]] = value
        elif path.startswith("sampling."):
            wire["sampling"][path[9:]] = value
        else:
            wire[path] = value

    _decodes_or_codec_error(rewrite(make_group(), edit))


_finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def valid_groups(draw):
    samples = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(0, 6))
        ints = lambda hi: st.lists(st.integers(0, hi), min_size=n, max_size=n)  # noqa: E731
        mask = draw(st.none() | ints(1))
        samples.append(Sample(
            completion_ids=np.array(draw(ints(VOCAB - 1)), dtype=np.int32),
            logprobs=np.array(draw(st.lists(st.floats(-50, 0, width=32), min_size=n, max_size=n)), np.float32),
            versions=np.array(draw(ints(MAX_VERSION)), dtype=np.int32),
            reward=draw(_finite),
            finish_reason=draw(st.sampled_from(FINISH_REASONS)),
            loss_mask=None if mask is None else np.array(mask, dtype=np.uint8),
            reward_info=draw(st.dictionaries(st.text(max_size=5), _finite, max_size=2)),
        ))
    return Group(
        group_id=new_group_id(),
        prompt_id=draw(st.text(max_size=8)),
        generator_id=draw(st.text(max_size=8)),
        prompt_ids=np.array(draw(st.lists(st.integers(0, VOCAB - 1), max_size=8)), dtype=np.int32),
        samples=samples,
        sampling=Sampling(draw(_finite), draw(_finite), draw(st.integers(-1, 100)), draw(st.integers(1, 4096))),
        created_at=draw(_finite),
        meta=draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5) | st.integers(-5, 5) | _finite,
                                  max_size=3)),
    )


@FUZZ
@given(valid_groups())
def test_valid_groups_round_trip(group):
    out = decode(encode_group(group))
    assert_same_group(group, out)
    assert out.min_version() == group.min_version()
    assert all(math.isfinite(r) for r in out.rewards())


ROUTED = JobLimits(**{**LIMITS.__dict__, "routing": (2, 2, 4)})
"""LIMITS of a job that replays MoE routes: 2 layers, top 2 of 4 experts."""


def routed_group(**route_overrides) -> Group:
    """make_group's samples with routes: P + T - 1 positions (3 + 3 - 1 and 3 + 2 - 1) x 2 layers x top 2."""
    group = make_group()
    for sample in group.samples:
        rows = len(group.prompt_ids) + len(sample.completion_ids) - 1
        sample.routed_experts = np.arange(rows * 4, dtype=np.uint8).reshape(rows, 2, 2) % 4
    for index, routes in route_overrides.items():
        group.samples[int(index)].routed_experts = routes
    return group


def test_routes_cross_the_wire_when_the_job_replays_them_and_are_checked_against_the_model():
    group = routed_group()
    got = decode(encode_group(group), limits=ROUTED)
    for sent, back in zip(group.samples, got.samples):
        np.testing.assert_array_equal(back.routed_experts, sent.routed_experts)
        assert back.routed_experts.dtype == np.uint8
    plain = make_group()
    assert encode_group(plain) == encode_group(make_group(group_id=plain.group_id, samples=plain.samples))  # no key
    for bad, reason, detail in (
            (routed_group(**{"0": np.zeros((4, 2, 2), np.uint8)}), "bad_route", "not [5 positions"),
            (routed_group(**{"1": np.full((4, 2, 2), 4, np.uint8)}), "bad_route", "expert 4 of a model with 4"),
            (routed_group(**{"0": None}), "bad_route", "missing"),
            (routed_group(**{"0": np.zeros((5, 1, 2), np.uint8)}), "bad_route", "bytes, not"),
    ):
        err = reject(encode_group(bad), limits=ROUTED)
        assert err.reason == reason and detail in str(err), str(err)
    err = reject(encode_group(routed_group()), limits=LIMITS)  # routes sent to a job that replays none
    assert err.reason == "malformed" and "does not replay routes" in str(err)
    err = reject(rewrite(routed_group(), lambda wire: wire["samples"][0].update(routed_experts="zz")), limits=ROUTED)
    assert err.reason == "malformed" and "expected bytes" in str(err)
    with pytest.raises(TypeError, match="uint8 or uint16"):
        encode_group(routed_group(**{"0": np.zeros((5, 2, 2), np.int64)}))


def test_a_batch_puts_each_samples_routes_at_its_positions_and_minus_one_elsewhere():
    from asyncrl.learner.batch import build_batch

    group = routed_group()
    batch = build_batch([group])
    routes = batch.routed_experts
    assert routes.dtype == torch.int16 and tuple(routes.shape) == (2, 6, 2, 2)
    np.testing.assert_array_equal(routes[0, :5].numpy(), group.samples[0].routed_experts)
    np.testing.assert_array_equal(routes[1, :4].numpy(), group.samples[1].routed_experts)
    assert (routes[0, 5:] == -1).all() and (routes[1, 4:] == -1).all()
    assert build_batch([make_group()]).routed_experts is None
    micro = batch.select(torch.tensor([1]))
    assert tuple(micro.routed_experts.shape) == (1, 5, 2, 2)  # trimmed to the row's length, as every [B, L] field
