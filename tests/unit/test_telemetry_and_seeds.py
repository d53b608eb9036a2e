"""Small contracts the docs state: the MLflow queue drops the oldest report when full, the job's experiment opens in
MLflow's model-training view, a generator's sampling seed follows its id, and the learner publishes every
weightsync.every_steps versions and always the last."""
import threading

from asyncrl.generator.main import sampling_seed
from asyncrl.learner.loop import should_publish
from asyncrl.telemetry.mlflow_logger import (EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND, DropOldestQueue,
                                             create_or_attach_run)


def test_a_full_metrics_queue_drops_the_oldest_report_and_counts_it():
    queue = DropOldestQueue(maxsize=2)
    for item in ("a", "b", "c", "d"):
        queue.put(item)
    assert queue.dropped == 2 and [queue.get(), queue.get()] == ["c", "d"]


def test_a_waiting_consumer_gets_the_next_report():
    queue = DropOldestQueue(maxsize=2)
    got = []
    consumer = threading.Thread(target=lambda: got.append(queue.get()))
    consumer.start()
    queue.put("x")
    consumer.join(timeout=5)
    assert got == ["x"] and queue.dropped == 0


def test_the_jobs_experiment_is_tagged_as_model_training_unless_it_has_a_kind(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run = client.get_run(create_or_attach_run(uri, "asyncrl-new", "job"))
    assert client.get_experiment(run.info.experiment_id).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND
    untagged = client.create_experiment("made-elsewhere")
    chosen = client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    create_or_attach_run(uri, "made-elsewhere", "job")
    create_or_attach_run(uri, "chosen", "job")
    assert client.get_experiment(untagged).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"


def test_a_resumed_learner_logs_into_its_checkpoints_run_and_a_lost_run_gets_a_new_one(tmp_path, monkeypatch,
                                                                                        caplog):
    from mlflow.tracking import MlflowClient

    from asyncrl.learner.state import LearnerState

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    first = create_or_attach_run(uri, "asyncrl", "job")
    client.set_terminated(first, "FAILED")  # the first life died
    state = LearnerState(version=5, mlflow_run_id=first)
    again = create_or_attach_run(uri, "asyncrl", "job", LearnerState.from_json(state.to_json()).mlflow_run_id)
    assert again == first and client.get_run(first).info.status == "RUNNING"
    from asyncrl.telemetry.mlflow_logger import MetricsLogger

    for params in ({"learner.total_steps": 3, "job.name": "job"},
                   {"learner.total_steps": 4, "job.name": "job", "new.key": 1}):
        logger = MetricsLogger(uri, first)
        logger.log_params(params)  # the second life's changed value raises nothing
        logger.close()
    run = client.get_run(first).data
    assert run.params == {"learner.total_steps": "3", "job.name": "job", "new.key": "1"}
    assert run.tags["resumed_with/learner.total_steps"] == "4"
    assert create_or_attach_run(uri, "asyncrl", "job") != first  # a fresh job: a run of its own
    with caplog.at_level("WARNING"):
        lost = create_or_attach_run(uri, "asyncrl", "job", "0123456789abcdef0123456789abcdef")
    assert lost != first and "is not in" in caplog.text
    client.delete_run(first)
    assert create_or_attach_run(uri, "asyncrl", "job", first) != first


def test_the_sampling_seed_follows_the_generator_id_not_the_process():
    assert sampling_seed(7, "gen-0") == sampling_seed(7, "gen-0")
    assert sampling_seed(7, "gen-0") != sampling_seed(7, "gen-1")
    assert sampling_seed(8, "gen-0") == sampling_seed(7, "gen-0") + 1


def test_weights_are_published_every_k_versions_and_always_the_last():
    assert [v for v in range(1, 8) if should_publish(v, 3, total_steps=7)] == [3, 6, 7]
    assert [v for v in range(1, 5) if should_publish(v, 1, total_steps=4)] == [1, 2, 3, 4]
