"""The typed messages between the learner and its generators, built for tests that carry them without acting on
them (buffers, the rollout loop's bookkeeping): a real `WeightsAnnouncement`, made the way the publisher makes it,
and a real `RunInfo`."""
from asyncrl.buffer.interface import RunInfo
from asyncrl.weightsync.layout import announcement_for, plan_layout


def announcement(version: int = 1, publisher: str = "life-1", tensors: int = 1, **places):
    """`tensors` float32 tensors of 4 elements; `places`: WeightsAnnouncement fields (shm, catchup, broadcast,
    engines, lora)."""
    layout = plan_layout([(f"w{index}", "float32", (4,)) for index in range(tensors)], 1 << 20)
    return announcement_for(layout, version, ["0" * 16] * len(layout.bucket_sizes), publisher=publisher,
                            published_at=0.0, **places)


def run_info(**fields) -> RunInfo:
    """A run on no model and no data; `fields` override any of RunInfo's."""
    return RunInfo(**{"model_path": "/nonexistent/model", "train_files": (), "mlflow_run_id": "", "tracking_uri": "",
                      "host": "test", "job_dir": "/nonexistent/job", "job": "test", **fields})
