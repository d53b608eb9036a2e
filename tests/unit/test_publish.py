"""Rank 0's side of publishing (learner/publish.py::VersionPublisher): each version is announced to the buffer
after it is published, and a version that repeats the previous one's bytes after a trained step is counted, except
where it is expected (no gradient, the critic's warmup)."""
import logging

from asyncrl.learner.publish import VersionPublisher, repeats_previous
from asyncrl.weightsync.layout import announcement_for, plan_layout

LAYOUT = plan_layout([("w", "float32", (16,))], 1 << 20)  # 64 bytes in one bucket


class ScriptedPublisher:
    """weightsync's publisher, reduced to the announcement it returns: `checksums[version]` are its bytes."""

    catchup = None

    def __init__(self, checksums: dict):
        self.checksums = checksums
        self.closed = False

    def publish(self, weights, version, specs, extra=None):
        return announcement_for(LAYOUT, version, self.checksums[version], publisher="life-1", published_at=0.0,
                                **(extra or {}))

    def close(self):
        self.closed = True


class RecordingBuffer:
    def __init__(self):
        self.calls = []

    def announce_weights(self, message):
        self.calls.append(("announce", message.version))

    def set_version(self, version):
        self.calls.append(("set_version", version))


def test_each_version_is_announced_then_admission_moves_to_it():
    buffer = RecordingBuffer()
    publishing = VersionPublisher(ScriptedPublisher({1: ["a"], 2: ["b"]}), buffer, version=0)
    publishing.publish(iter(()), 1, [], full_bytes=128)
    assert publishing.take_metrics()["weightsync/publish_bytes_frac"] == 0.5
    assert publishing.take_metrics() == {}  # logged once, with the step that published it
    publishing.publish(iter(()), 2, [])
    assert buffer.calls == [("announce", 1), ("set_version", 1), ("announce", 2), ("set_version", 2)]
    assert publishing.version == 2 and publishing.unchanged_versions == 0


def test_repeated_bytes_after_a_trained_step_are_counted_and_logged(caplog):
    same = {version: ["x"] for version in range(1, 6)}
    publishing = VersionPublisher(ScriptedPublisher(same), RecordingBuffer(), version=0, unchanged_until=2)
    with caplog.at_level(logging.ERROR, logger="asyncrl.learner.publish"):
        publishing.publish(iter(()), 1, [])  # the first version repeats nothing
        publishing.publish(iter(()), 2, [])  # the critic's warmup: the policy stays on purpose
        publishing.publish(iter(()), 3, [], moved=False)  # no gradient (every advantage 0)
        assert publishing.unchanged_versions == 0 and not caplog.records
        publishing.publish(iter(()), 4, [], extra={"lora": {"rank": 8}})
    assert publishing.unchanged_versions == 1
    assert "v4 sends exactly the bytes of the version before it (64 bytes, the LoRA adapter)" in caplog.text
    assert publishing.take_metrics()["weightsync/unchanged_versions"] == 1.0


def test_a_version_repeats_the_previous_one_only_with_the_same_layout_and_every_checksum():
    first = announcement_for(LAYOUT, 1, ["a"], publisher="life-1", published_at=0.0)
    repeated, key = repeats_previous(None, first)
    assert not repeated and key == (LAYOUT.fingerprint, ("a",))
    assert repeats_previous(key, announcement_for(LAYOUT, 2, ["a"], publisher="life-1", published_at=1.0))[0]
    assert not repeats_previous(key, announcement_for(LAYOUT, 2, ["b"], publisher="life-1", published_at=1.0))[0]
