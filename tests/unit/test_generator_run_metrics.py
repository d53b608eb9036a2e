"""generator/run_metrics.py on a real sqlite MLflow store: a generator that waited for its learner to be resumed
follows the resumed learner's run (a run of its own), so its metrics sit beside that learner's."""
import socket

from mlflow.tracking import MlflowClient

from asyncrl.generator.run_metrics import GeneratorRunMetrics
from tests.messages import run_info


def test_metrics_follow_the_run_the_resumed_learner_names(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("job")
    first, second = (client.create_run(experiment).info.run_id for _ in range(2))
    metrics = GeneratorRunMetrics("gen-0", system_metrics_every_s=0)
    here = socket.gethostname()
    metrics.follow(run_info(mlflow_run_id=first, tracking_uri=uri, host=here))
    metrics.log({"generator/version": 7.0}, step=7)
    metrics.follow(run_info(mlflow_run_id=first, tracking_uri=uri, host=here))  # the same learner answers again
    metrics.follow(run_info(mlflow_run_id=second, tracking_uri=uri, host=here))  # resumed: its versions go back
    metrics.log({"generator/version": 5.0}, step=5)
    metrics.close()
    history = {run: [(m.step, m.value) for m in client.get_metric_history(run, "gen-0/generator/version")]
               for run in (first, second)}
    assert history == {first: [(7, 7.0)], second: [(5, 5.0)]}
    metrics.log({"generator/version": 6.0}, step=6)  # after close: dropped, not an error


def test_a_learner_logging_to_a_file_on_another_host_gets_no_generator_metrics(tmp_path):
    metrics = GeneratorRunMetrics("gen-0", system_metrics_every_s=0)
    metrics.follow(run_info(mlflow_run_id="abc", tracking_uri=f"sqlite:///{tmp_path}/x.db", host="elsewhere"))
    assert metrics.run_id == "abc" and metrics._logger is None
    metrics.log({"generator/version": 1.0}, step=1)
    metrics.close()
