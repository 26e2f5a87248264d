"""MLflow against a real tracking server (`mlflow server`, sqlite store, on 127.0.0.1): a run's params and metrics
reach it and its run ends FINISHED, or KILLED on SIGTERM; a store that cannot be used stops the run before the model
loads, in one line."""

import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import TORCHRUN, WORKERS, free_port, run, worker_env, write_tiny_job

import train

pytest.importorskip("mlflow.server", reason="the full mlflow (requirements-dev.txt), not mlflow-skinny")
from mlflow.tracking import MlflowClient  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`mlflow server` as a user would start one, lean for a CI runner (one worker, no job runner): its URI."""
    tmp, port = tmp_path_factory.mktemp("mlflow"), free_port()
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{tmp}/mlflow.db", "--default-artifact-root", str(tmp / "artifacts")]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(tmp / "server.log", "w") as log:
        proc = subprocess.Popen(command, cwd=tmp, env=env, stdout=log, stderr=log, start_new_session=True)
    uri, deadline = f"http://127.0.0.1:{port}", time.time() + 90
    try:
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                    break
            assert proc.poll() is None and time.time() < deadline, (tmp / "server.log").read_text()[-3000:]
            time.sleep(0.25)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn worker
        proc.wait(timeout=30)


def job(tmp_path, tiny_model_dir, **settings):
    settings = {"max_steps": 3, "log_every": 1, "save_every": 0, "output_dir": str(tmp_path / "out"), **settings}
    return write_tiny_job(tmp_path / "job.yaml", tiny_model_dir, param_dtype="float32", **settings)


def experiment(uri: str, name: str) -> str:
    return MlflowClient(uri).create_experiment(name)


@pytest.mark.distributed
def test_a_run_logs_its_params_and_metrics_to_a_tracking_server_and_ends_finished(server, tiny_model_dir, tmp_path):
    env = {"MLFLOW_TRACKING_URI": server, "MLFLOW_EXPERIMENT_ID": experiment(server, "finished")}
    rc, out, err = run([*TORCHRUN, "train.py", "--config", str(job(tmp_path, tiny_model_dir))], worker_env(**env))
    assert rc == 0, out[-2000:] + err[-3000:]
    client = MlflowClient(server)
    [run_] = client.search_runs([env["MLFLOW_EXPERIMENT_ID"]])
    assert run_.info.status == "FINISHED"
    assert run_.data.params["max_seq_len"] == "1024" and len(run_.data.params) == len(dataclasses.fields(train.Config))
    losses = [m.value for m in client.get_metric_history(run_.info.run_id, "loss")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert {"lr", "grad_norm", "tokens_per_s_per_gpu", "memory_gib"} <= set(run_.data.metrics)


@pytest.mark.distributed
def test_a_sigterm_ends_the_platforms_run_killed_with_its_checkpoint(server, tiny_model_dir, tmp_path):
    """As the platform runs a job: its run exists (MLFLOW_RUN_ID); a scheduler's SIGTERM to torchrun mid-run."""
    run_id = MlflowClient(server).create_run(experiment(server, "killed")).info.run_id
    config = job(tmp_path, tiny_model_dir, max_steps=50)
    env = worker_env(MLFLOW_TRACKING_URI=server, MLFLOW_RUN_ID=run_id)
    rc, out, err = run([*TORCHRUN, str(WORKERS / "fault_worker.py"), str(config), "sigterm-launcher-at-2"], env)
    assert rc != 0 and "stopped by SIGTERM after step" in out + err, out[-2000:] + err[-3000:]
    assert list((tmp_path / "out/checkpoints").glob("step_*/complete.json"))
    run_ = MlflowClient(server).get_run(run_id)
    assert run_.info.status == "KILLED" and "loss" in run_.data.metrics


@pytest.mark.parametrize(
    "env, message",
    [
        ({"MLFLOW_TRACKING_URI": "file:{tmp}/mlruns"}, "(The filesystem tracking backend"),
        ({"MLFLOW_TRACKING_URI": "http://127.0.0.1:{closed}"}, "Connection refused"),
        ({"MLFLOW_TRACKING_URI": "{server}", "MLFLOW_RUN_ID": "0" * 32}, f"Run with id={'0' * 32} not found"),
    ],
    ids=["file_store", "unreachable", "no_such_run"],
)
def test_a_store_it_cannot_use_stops_the_run_before_the_model_loads(env, message, server, tiny_model_dir, tmp_path):
    values = {"tmp": tmp_path, "closed": free_port(), "server": server}
    env = worker_env(
        **{k: v.format(**values) for k, v in env.items()},
        MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
        MLFLOW_HTTP_REQUEST_TIMEOUT="5",
    )
    env.pop("MLFLOW_ALLOW_FILE_STORE", None)
    start = time.time()
    rc, out, err = run([sys.executable, "train.py", "--config", str(job(tmp_path, tiny_model_dir))], env)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1 and message in errors[0], out[-2000:] + err[-3000:]
    assert (
        f"MLflow tracking store {env['MLFLOW_TRACKING_URI']} cannot be used (" in errors[0] and "Traceback" not in err
    )
    assert "MLFLOW_ALLOW_FILE_STORE=true" in errors[0]  # what to do, whichever the cause
    assert "model: " not in out and not (tmp_path / "out/config.yaml").exists()
    assert not list((tmp_path / "out").iterdir())  # nothing loaded, nothing written
    assert time.time() - start < 60


def test_a_notebooks_run_takes_every_train_call_and_every_skip_reason(
    server, tiny_model_dir, world_of_one, tmp_path, monkeypatch
):
    """A notebook calls train() again under its decorator's MLFLOW_RUN_ID, which mlflow.end_run unsets: the second
    call logged to a new run. And a skip reason may hold characters MLflow refuses in a metric's name, which lost the
    whole batch it was in (every data_seen/* number)."""
    from transformers import AutoModelForCausalLM

    model, client = AutoModelForCausalLM.from_pretrained(tiny_model_dir), MlflowClient(server)
    run_id = client.create_run(experiment(server, "notebook")).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    reason, cfg = "reasoning the template does not render (set reasoning: drop)", train.Config(output_dir=str(tmp_path))
    error = "chat template error: see https://example.com/ or user/assistant/"  # // and a last / : no MLflow name
    for call in (1, 2):  # each train() call's MetricsLog
        with train.MetricsLog(cfg, world_of_one, model) as log:
            log.write({"step": call, "data_seen": {"conversations": 10 * call, reason: call, error: 1}})
        assert os.environ.get("MLFLOW_RUN_ID") == run_id
    history = client.get_metric_history(run_id, "data_seen/conversations")
    assert [(m.step, m.value) for m in history] == [(1, 10), (2, 20)]
    run = client.get_run(run_id)
    assert run.data.metrics["data_seen/reasoning the template does not render _set reasoning_ drop_"] == 2
    assert run.data.metrics["data_seen/chat template error_ see https__/example.com/ or user/assistant_"] == 1
    assert run.info.status == "FINISHED"
