"""What TensorBoard, W&B (offline) and SwanLab (offline) wrote, read back from their files with each library's own
readers and record types: {metric: [(step, value), ...]} in the order written, and what else a test checks."""
import glob
import os
import struct


def leveldb_records(path: str, ident: bytes) -> list:
    """The records of a LevelDB-log file as W&B (`.wandb`) and SwanLab (`.swanlab`) write them: a 7-byte file
    header, 32 KiB blocks, each record a 7-byte header (crc32, length, type: full, first, middle, last)."""
    data = open(path, "rb").read()
    assert data[:4] == ident, data[:8]
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def tensorboard_run(folder: str):
    """The scalars of the one TensorBoard run in `folder` (<tracker dir>/tensorboard/<run name>), and its tensors'
    tags (text summaries)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder)
    events.Reload()
    points = {key: [(e.step, e.value) for e in events.Scalars(key)] for key in events.Tags()["scalars"]}
    return points, events.Tags()["tensors"]


def wandb_run(tracker_dir: str):
    """The one offline W&B run under `tracker_dir`: (points on its `step` axis, config {key: JSON}, run record,
    tables {name: [(step, rows), ...]})."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(tracker_dir, "wandb", "wandb", "offline-run-*", "run-*.wandb"))
    points, config, run, tables = {}, {}, None, {}
    for data in leveldb_records(path, b":W&B"):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            names = [key[:-len("/_type")] for key, value in row.items()
                     if key.endswith("/_type") and value == '"table-file"']  # a table is <name>/<field> keys
            for name in names:
                tables.setdefault(name, []).append((int(row["step"]), int(row[name + "/nrows"])))
            for key, value in row.items():
                if not key.startswith("_") and key != "step" and not key.startswith(tuple(f"{n}/" for n in names)):
                    points.setdefault(key, []).append((int(row["step"]), float(value)))
        elif kind == "config":
            config.update({item.key or "/".join(item.nested_key): item.value_json for item in record.config.update})
        elif kind == "run":
            run = record.run
    return points, config, run, tables


def swanlab_run(tracker_dir: str):
    """The one offline SwanLab run under `tracker_dir`: (points, its start record, its finish record or None, the
    text of its config.yaml)."""
    from swanlab.proto.swanlab.record.v1 import record_pb2

    (path,) = glob.glob(os.path.join(tracker_dir, "swanlog", "run-*", "run-*.swanlab"))
    points, start, finish = {}, None, None
    for data in leveldb_records(path, b":SWL"):
        record = record_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "scalar":
            points.setdefault(record.scalar.key, []).append((record.scalar.step, record.scalar.value.number))
        elif kind == "start":
            start = record.start
        elif kind == "finish":
            finish = record.finish
    config = open(os.path.join(os.path.dirname(path), "files", "config.yaml")).read()
    return points, start, finish, config
