"""The Databricks surface: the shipped workload YAMLs, their parameters, MLflow, and the notebook entry point."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, TORCHRUN, fake_cuda_home, worker_env, write_tiny_job

import train

WORKLOADS = [ROOT / "workload.yaml", *sorted((ROOT / "examples").glob("*x*.yaml"))]
TOP_LEVEL = {
    "experiment_name",
    "environment",
    "compute",
    "code_source",
    "env_variables",
    "secrets",
    "parameters",
    "max_retries",
    "timeout_minutes",
    "command",
}
ACCELERATORS = {"GPU_8xB300": 8, "GPU_8xB200": 8, "GPU_8xH100": 8, "GPU_8xH200": 8, "GPU_1xA10": 1, "GPU_1xH100": 1}


def test_the_default_job_and_the_multi_node_example_are_shipped():
    names = [w.name for w in WORKLOADS]
    assert names == ["workload.yaml", "llama3.1-8b-2x8xH100.yaml"]


@pytest.mark.parametrize("path", WORKLOADS, ids=lambda p: p.name)
def test_workload_follows_the_ai_runtime_rules(path):
    w = yaml.safe_load(path.read_text())
    assert {"experiment_name", "compute", "command"} <= set(w) and set(w) <= TOP_LEVEL, set(w) - TOP_LEVEL
    gpus_per_node = ACCELERATORS[w["compute"]["accelerator_type"]]
    assert w["compute"]["num_accelerators"] % gpus_per_node == 0
    assert w["code_source"]["type"] == "snapshot" and set(w["code_source"]) == {"type", "snapshot"}
    assert w["environment"]["version"] == "databricks_ai_v6"
    assert all(isinstance(v, str) for v in w.get("env_variables", {}).values())
    for name, ref in w.get("secrets", {}).items():
        assert isinstance(ref, str) and len(ref.split("/")) == 2 and all(ref.split("/")), (name, ref)
    train.load_config((str(path), w["parameters"]))  # raises on a key train.py does not have, or a bad value
    assert w["parameters"]["output_dir"].startswith("/Volumes/")
    assert w["max_retries"] >= 1  # a retry resumes from the last checkpoint
    assert "torchrun" in w["command"] and '"${NUM_NODES:-1}"' in w["command"]


def upload_folder(path: Path) -> Path:
    """The folder the platform uploads: code_source.snapshot.root_path, a relative one resolved against the YAML
    file's folder (as both `databricks air run` and the databricks-air package resolve it)."""
    root = Path(yaml.safe_load(path.read_text())["code_source"]["snapshot"]["root_path"])
    return (root if root.is_absolute() else path.parent / root).resolve()


def uploaded_files(folder: Path) -> list[str]:
    """What its snapshot holds: the folder's files less those .gitignore names."""
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    return subprocess.run(listed, cwd=folder, capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.parametrize("path", WORKLOADS, ids=lambda p: p.name)
def test_workload_uploads_the_recipe(path):
    assert {"train.py", "requirements.txt", "scripts/setup_node.sh"} <= set(uploaded_files(upload_folder(path)))


@pytest.mark.parametrize("path", WORKLOADS, ids=lambda p: p.name)
def test_workload_passes_the_platform_validator(path, tmp_path, monkeypatch):
    """databricks-air's own loader (what its `air run` checks before submitting): the schema, the files, the
    upload folder. No workspace is configured, so its accelerator availability query is skipped."""
    from cli.run_config import _load_and_validate_yaml

    for key in ("DATABRICKS_HOST", "DATABRICKS_TOKEN", "DATABRICKS_CONFIG_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DATABRICKS_CONFIG_FILE", str(tmp_path / "no-databrickscfg"))
    config, _ = _load_and_validate_yaml(path)
    assert Path(config.code_source.snapshot.repo_path).resolve() == upload_folder(path) == ROOT


def test_multi_node_example_takes_the_token_from_a_secret():
    w = yaml.safe_load((ROOT / "examples/llama3.1-8b-2x8xH100.yaml").read_text())
    assert w["compute"] == {"accelerator_type": "GPU_8xH100", "num_accelerators": 16}
    assert w["secrets"] == {"HF_TOKEN": "my_scope/hf_token"} and "HF_TOKEN" not in w["env_variables"]
    assert w["env_variables"]["NCCL_SOCKET_IFNAME"] == "eth0"


def tiny_override(tmp_path, tiny_model_dir, **extra):
    return write_tiny_job(
        tmp_path / "tiny.yaml",
        tiny_model_dir,
        tokenizer_name="",
        dataset_split="train",
        eval_split="",  # the example's is a hub split: eval on held-out records of the sample instead
        eval_fraction=0.1,
        eval_blocks=1,
        max_steps=3,
        save_every=0,
        param_dtype="float32",
        log_every=1,
        output_dir=str(tmp_path / "out"),
        **extra,
    )


@pytest.mark.distributed
@pytest.mark.parametrize("path", WORKLOADS, ids=lambda p: p.name)
def test_workload_command_runs_with_its_parameters(path, tiny_model_dir, tmp_path):
    """The command as the platform runs it: once per node, under bash, in a copy of what it uploads at
    CODE_SOURCE_PATH, with its env_variables and the parameters file. The node setup runs as a dry run (for an
    H100/H200: no compile, no install; tests/test_node_setup.py) and the job is overridden to a tiny 2-rank CPU
    run."""
    w = yaml.safe_load(path.read_text())
    code = tmp_path / "code_source" / upload_folder(path).name
    for name in uploaded_files(upload_folder(path)):
        (code / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(upload_folder(path) / name, code / name)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(w["parameters"]))
    env = {
        **os.environ,
        **w["env_variables"],
        "HF_HOME": str(tmp_path / "hf"),
        "CODE_SOURCE_PATH": str(code),
        "HYPERPARAMETERS_PATH": str(tmp_path / "params.yaml"),
        "NODE_SETUP_DRY_RUN": "1",
        "GPU_ARCH": "90",
        "CUDA_HOME": str(fake_cuda_home(tmp_path)),
        "WHEEL_CACHE": str(tmp_path / "wheel-cache"),
        "NUM_NODES": "1",
        "NODE_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(train.free_port()),
        "TRAIN_ARGS": f"--config {tiny_override(tmp_path, tiny_model_dir)}",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    proc = subprocess.run(
        ["bash", "-c", w["command"]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "\ndry run: " in proc.stdout  # the node setup ran to its end
    assert "step 3/3" in proc.stdout and (tmp_path / "out/model/config.json").exists()
    resolved = yaml.safe_load((tmp_path / "out/config.yaml").read_text())
    for key in set(w["parameters"]) - set(yaml.safe_load((tmp_path / "tiny.yaml").read_text())):
        assert resolved[key] == w["parameters"][key], key  # the parameters block reached train.py


@pytest.mark.distributed
def test_mlflow_gets_params_and_metrics_and_no_secret(tiny_model_dir, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"file://{tmp_path}/mlruns"
    env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true"}
    os.environ.update(env)
    try:
        client = MlflowClient(uri)
        run_id = client.create_run("0").info.run_id  # as the platform creates the job's run
    finally:
        for key in env:
            os.environ.pop(key)
    config = tiny_override(tmp_path, tiny_model_dir)
    env = worker_env(**env, MLFLOW_RUN_ID=run_id, HF_TOKEN="hf_SECRETtokenVALUE123")
    proc = subprocess.run(
        [*TORCHRUN, "train.py", "--config", str(config)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = client.get_run(run_id)
    assert run.data.params["learning_rate"] == str(train.Config().learning_rate)
    assert run.data.params["max_seq_len"] == "1024"
    losses = [m.value for m in client.get_metric_history(run_id, "loss")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    for name in ("eval_loss", "lr", "grad_norm", "tokens_per_s_per_gpu", "non_padding_fraction", "loss_token_fraction"):
        assert client.get_metric_history(run_id, name), name
    assert "mfu" not in run.data.metrics  # no known peak on CPU: not logged rather than logged wrong
    everything = [proc.stdout, proc.stderr, json.dumps(run.data.params)]
    everything += [p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size < 1e7]
    assert not any("SECRETtoken" in text for text in everything)


@pytest.mark.distributed
def test_notebook_entry_point_runs_in_processes_started_like_the_decorator(tiny_model_dir, tmp_path):
    """@distributed starts one process per GPU with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_* set, and calls the
    function there: no torchrun."""
    config = yaml.safe_load(tiny_override(tmp_path, tiny_model_dir).read_text())
    call = "import json, sys, train; print('RESULT', json.dumps(train.train(json.loads(sys.argv[1]))))"
    port = str(train.free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", call, json.dumps(config)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": "1",
            },
        )
        for r in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.split("RESULT ", 1)[1]))
    assert results[0] == results[1]
    assert results[0]["steps"] == 3 and math.isfinite(results[0]["final_loss"]) and results[0]["eval_loss"]
    assert Path(results[0]["model_dir"], "config.json").exists()
