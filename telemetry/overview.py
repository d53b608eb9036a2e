"""The charts a run opens on in MLflow, and the link that opens it in the model-training view (stdlib only).

MLflow's run page ("Model metrics") draws one section per metric prefix, sections and the charts in each sorted
by plain character order; MLflow 3.17, the version measured, gives no way to order them from the logging side.
By that order `advantage/` and `buffer/dropped/` come first and `reward/` far down. So the learner also logs the
few metrics a person checks first under `RL overview/`: an upper-case name sorts before every lower-case prefix,
and the numbers keep the charts in the order below. The original keys are logged as well, unchanged.

MLflow 3.17 picks the GenAI or the model-training view from the `workflowType` query parameter, else from the
browser's last choice (GenAI at first); older 3.x releases read the experiment's `mlflow.experimentKind` tag,
which mlflow_logger.py sets. `run_page_url` builds a link that opens the run's charts in either.
"""

SECTION = "RL overview"
OVERVIEW = (
    ("reward/sampled_mean", "01 reward sampled"),
    ("reward/mean", "02 reward trained groups"),
    ("eval/all/mean_reward", "03 held-out reward"),
    ("buffer/staleness/mean", "04 staleness mean"),
    ("buffer/staleness/max", "05 staleness max"),
    ("offpolicy/mismatch_k3", "06 mismatch k3"),
    ("offpolicy/is_weight/ess", "07 IS weight ESS"),
    ("offpolicy/is_weight/max", "08 IS weight max"),
    ("offpolicy/masked_frac", "09 masked token frac"),
    ("timing/learner/idle_frac", "10 learner idle frac"),
    ("timing/generator/idle_frac", "11 generator idle frac"),
    ("perf/learner/tokens_per_s", "12 learner tokens per s"),
    ("perf/generator/tokens_per_s", "13 generator tokens per s"),
)
"""(the metric, its name in the overview section). The reward of every group the policy sampled comes first (the
number to compare with another framework's); the trained groups' follows, named: dynamic sampling leaves out the
groups whose samples all scored alike, so it reads higher (buffer/sampled.py)."""


def with_overview(metrics: dict) -> dict:
    """The report plus an `RL overview/...` copy of each OVERVIEW metric it has."""
    extra = {f"{SECTION}/{name}": metrics[key] for key, name in OVERVIEW if key in metrics}
    return {**metrics, **extra}


def run_page_url(server: str, experiment_id: str, run_id: str) -> str:
    """The run's chart page in the MLflow UI at `server` (http://host:port), in the model-training view."""
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics?workflowType=machine_learning"
