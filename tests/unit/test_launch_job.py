"""launch/job.py: what the CLI and the supervisor share, so neither imports the other."""
import ast
import os
from types import SimpleNamespace

from asyncrl.launch.job import job_dir_for, print_sft_result

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def imported_modules(path: str) -> set:
    tree = ast.parse(open(os.path.join(REPO, path)).read())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | \
        {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}


def test_the_cli_and_the_supervisor_do_not_import_each_other():
    assert "asyncrl.launch.cli" not in imported_modules("launch/supervisor.py")
    assert "asyncrl.launch.supervisor" not in imported_modules("launch/job.py")
    assert "asyncrl.launch.cli" not in imported_modules("launch/job.py")


def test_the_job_directory_is_the_launchers_when_it_chose_one(tmp_path, monkeypatch):
    job = SimpleNamespace(out_dir=str(tmp_path / "runs"), name="j")
    monkeypatch.setenv("ASYNCRL_JOB_DIR", str(tmp_path / "chosen"))
    assert job_dir_for(job) == str(tmp_path / "chosen") and (tmp_path / "chosen").is_dir()
    monkeypatch.delenv("ASYNCRL_JOB_DIR")
    made = job_dir_for(job)
    assert os.path.dirname(made) == str(tmp_path / "runs") and os.path.basename(made).startswith("j-")


def test_an_sft_result_prints_its_loss_and_where_the_model_went(capsys):
    print_sft_result(SimpleNamespace(losses=[2.0, 1.5], val_losses=[(1, 1.7)], start_step=0, out_dir="/m"))
    assert capsys.readouterr().out == ("sft: 2 steps from step 0, loss 2.0000 -> 1.5000; validation loss 1.7000; "
                                       "model saved to /m\n")
    print_sft_result(SimpleNamespace(losses=[], val_losses=[], start_step=4, out_dir="/m"))
    assert capsys.readouterr().out == "sft: 0 steps; model saved to /m\n"
