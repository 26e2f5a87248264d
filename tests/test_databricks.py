"""The Databricks surface: the shipped workload YAMLs (each, beside train.py alone, is the whole job), their
parameters, MLflow, and the notebook entry point."""

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import air_schema
import pytest
import smollm2_demo as demo
import yaml
from conftest import ROOT, TORCHRUN, fake_cuda_home, free_port, run_process, worker_env, write_tiny_job

import train

WORKLOADS = sorted(ROOT.glob("*.yaml"))


def test_the_default_job_and_the_multi_node_example_are_shipped():
    assert [w.name for w in WORKLOADS] == ["llama3.1-8b-2x8xH100.yaml", "workload.yaml"]


@pytest.mark.parametrize("path", WORKLOADS, ids=lambda p: p.name)
def test_workload_follows_the_recipes_rules(path):
    w = yaml.safe_load(path.read_text())
    assert w["code_source"] == {"root_path": "."}  # the seed's form, and its folder: the YAML's own, with train.py
    assert w["environment"]["version"] == "databricks_ai_v6"
    train.load_config((str(path), w["parameters"]))  # raises on a key train.py does not have, or a bad value
    assert w["parameters"]["output_dir"].startswith("/Volumes/")
    assert w["max_retries"] >= 1  # a retry resumes from the last checkpoint
    assert "exec torchrun" in w["command"] and '"${NUM_NODES:-1}"' in w["command"]


@pytest.mark.parametrize("path", WORKLOADS, ids=lambda p: p.name)
def test_workload_passes_the_newest_cli_schema(path):
    """tests/air_schema.py: the rules of `databricks air run` (the Go CLI's newest loader), which takes both the
    flat code_source form and the legacy nested one."""
    w = yaml.safe_load(path.read_text())
    assert air_schema.validate(w, path.parent) == []
    assert air_schema.code_source_root(w, path) == ROOT


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"gpus": 8}, "field gpus not found"),
        ({"compute": {"accelerator_type": "GPU_8xA100", "num_accelerators": 8}}, "invalid GPU type"),
        ({"compute": {"accelerator_type": "GPU_8xB300", "num_accelerators": 12}}, "num_accelerators"),
        ({"secrets": {"HF_TOKEN": "scope_key"}}, "expected format 'scope/key'"),
        ({"code_source": {"root_path": ".", "snapshot": {"root_path": "."}}}, "cannot combine"),
        ({"code_source": {"root_path": "no-such-folder"}}, "no-such-folder"),
    ],
)
def test_the_schema_check_finds_what_the_cli_refuses(change, problem):
    w = yaml.safe_load((ROOT / "workload.yaml").read_text()) | change
    assert any(problem in p for p in air_schema.validate(w, ROOT)), air_schema.validate(w, ROOT)


@pytest.mark.parametrize("path", WORKLOADS, ids=lambda p: p.name)
def test_the_legacy_python_cli_takes_the_nested_form_only(path, tmp_path, monkeypatch):
    """databricks-air, the deprecated Python `air run` (its loader: the schema, the files, the upload folder; no
    workspace is configured, so its accelerator query is skipped): the shipped flat form is refused, and the
    same file with code_source: {type: snapshot, snapshot: {root_path: ...}} (README) passes."""
    from cli.run_config import YamlValidationError, _load_and_validate_yaml

    for key in ("DATABRICKS_HOST", "DATABRICKS_TOKEN", "DATABRICKS_CONFIG_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DATABRICKS_CONFIG_FILE", str(tmp_path / "no-databrickscfg"))
    w = yaml.safe_load(path.read_text())
    w["code_source"] = {"root_path": str(ROOT)}
    (tmp_path / "flat.yaml").write_text(yaml.safe_dump(w))
    with pytest.raises(YamlValidationError, match="Unknown field 'root_path'"):
        _load_and_validate_yaml(tmp_path / "flat.yaml")
    w["code_source"] = {"type": "snapshot", "snapshot": {"root_path": str(ROOT)}}
    (tmp_path / "nested.yaml").write_text(yaml.safe_dump(w))
    config, _ = _load_and_validate_yaml(tmp_path / "nested.yaml")
    assert Path(config.code_source.snapshot.repo_path).resolve() == ROOT


def uploaded_files(folder: Path) -> list[str]:
    """What a snapshot of folder holds: its files less those .gitignore names (git ls-files' view of it)."""
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    return subprocess.run(listed, cwd=folder, capture_output=True, text=True, check=True).stdout.split()


def test_the_repo_uploads_the_recipe_and_not_the_local_outputs():
    files = set(uploaded_files(ROOT))
    assert {"train.py", "workload.yaml", "llama3.1-8b-2x8xH100.yaml"} <= files
    assert not any(f.startswith((".venv/", "outputs/", ".tiny-model/")) for f in files)


def test_the_multi_node_example_takes_the_token_from_a_secret():
    w = yaml.safe_load((ROOT / "llama3.1-8b-2x8xH100.yaml").read_text())
    assert w["compute"] == {"accelerator_type": "GPU_8xH100", "num_accelerators": 16}
    assert w["secrets"] == {"HF_TOKEN": "my_scope/hf_token"} and "HF_TOKEN" not in w["env_variables"]
    assert w["env_variables"]["NCCL_SOCKET_IFNAME"] == w["env_variables"]["GLOO_SOCKET_IFNAME"] == "eth0"


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


def node_command(path: Path, tiny_model_dir, tmp_path, **node) -> tuple[list, dict]:
    """The workload at path and train.py alone in an empty folder, and the command and environment that run it as a
    node runs it (tools/run_workload.py): the node setup as a dry run for an H100/H200 (no compile, no install), the
    job overridden to a tiny CPU run; node: the platform's variables (LOCAL_WORLD_SIZE, NUM_NODES, ...)."""
    job = tmp_path / "job"
    job.mkdir()
    shutil.copy(path, job / path.name)
    shutil.copy(ROOT / "train.py", job / "train.py")
    kernel_caches = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")  # torch sets Inductor's in this process
    inherited = {k: v for k, v in os.environ.items() if k not in kernel_caches}
    env = {
        **inherited,
        "HF_HOME": str(tmp_path / "hf"),
        "GPU_ARCH": "90",
        "CUDA_HOME": str(fake_cuda_home(tmp_path)),
        "WHEEL_CACHE": str(tmp_path / "wheel-cache"),
        "KERNEL_CACHE": str(tmp_path / "kernel-cache"),
        "KERNEL_CACHE_SAVE_S": "600",  # no archive while the tiny run lasts: only the last look, when torchrun ends
        "TMPDIR": str(tmp_path),
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # this venv's python and torchrun
        **node,
    }
    command = [sys.executable, str(ROOT / "tools/run_workload.py"), str(job / path.name), "--dry-run"]
    return [*command, "--", "--config", str(tiny_override(tmp_path, tiny_model_dir))], env


@pytest.mark.distributed
@pytest.mark.parametrize("path", WORKLOADS, ids=lambda p: p.name)
def test_a_folder_holding_only_the_yaml_and_train_py_runs_the_job(path, tiny_model_dir, tmp_path):
    """The design card's copy-paste use: the YAML and train.py in an empty folder, its command run as a node runs
    it (tools/run_workload.py: its env_variables, its parameters file, CODE_SOURCE_PATH at that folder). The node
    setup runs as a dry run (for an H100/H200: no compile, no install; tests/test_node_setup.py) and the job is
    overridden to a tiny 2-rank CPU run."""
    command, env = node_command(path, tiny_model_dir, tmp_path, LOCAL_WORLD_SIZE="2")
    (tmp_path / "kernel-cache").mkdir()  # the archives a run before left on the volume: one file of each cache
    (tmp_path / "from-before").write_text("a compiled kernel")
    for kind in ("triton", "inductor"):
        with tarfile.open(tmp_path / f"kernel-cache/{kind}.tar", "w") as archive:
            archive.add(tmp_path / "from-before", arcname="./kernel/from-before")
        (tmp_path / f"{kind}-cache").mkdir()  # its cache on this node (TMPDIR's): a kernel compiled in this run
        (tmp_path / f"{kind}-cache/compiled-now").write_text("another kernel")
    proc = run_process(command, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "\ndry run: " in proc.stdout  # the node setup ran to its end
    assert "step 3/3" in proc.stdout and (tmp_path / "out/model/config.json").exists()
    if "KERNEL_CACHE" in yaml.safe_load(path.read_text())["env_variables"]:  # restored, then archived again
        time.sleep(2.5)  # node 0's archiver takes its last look within a second of torchrun's end, and ends
        for kind in ("triton", "inductor"):
            assert (tmp_path / f"{kind}-cache/kernel/from-before").exists(), kind
            with tarfile.open(tmp_path / f"kernel-cache/{kind}.tar") as archive:
                assert {"./kernel/from-before", "./compiled-now"} <= set(archive.getnames()), kind
        assert not list((tmp_path / "kernel-cache").glob("*.tar.*"))  # written aside, then renamed
    resolved = yaml.safe_load((tmp_path / "out/config.yaml").read_text())
    w = yaml.safe_load(path.read_text())
    for key in set(w["parameters"]) - set(yaml.safe_load((tmp_path / "tiny.yaml").read_text())):
        assert resolved[key] == w["parameters"][key], key  # the parameters block reached train.py


def test_train_py_flags_given_to_run_workload_reach_the_command_as_typed_or_are_refused(tmp_path):
    """The YAMLs' command expands TRAIN_ARGS unquoted (as on a node): a flag that word splitting would change (an
    empty value, a space, a glob) is refused by tools/run_workload.py, in one line, before the command runs."""
    workload = tmp_path / "echo.yaml"  # a command that prints the words train.py would get
    workload.write_text(yaml.safe_dump({"code_source": {"root_path": "."}, "command": 'printf "%s|" ${TRAIN_ARGS:-}'}))
    tool = [sys.executable, str(ROOT / "tools/run_workload.py"), str(workload), "--"]
    typed = ["--max_steps", "20", "--tokenizer_name=", "--output_dir", str(tmp_path / "out")]
    proc = subprocess.run(tool + typed, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "|".join(typed) + "|", proc.stdout + proc.stderr
    for value in ["", "two words", "*.yaml"]:
        proc = subprocess.run([*tool, "--eval_split", value], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and proc.stdout == "", proc.stdout
        assert f"so {value!r} would not reach train.py as typed" in proc.stderr.strip().splitlines()[0]


def test_run_workload_writes_one_parameters_file_per_content_not_per_run(tmp_path):
    """tools/run_workload.py hands the parameters block to the command in $HYPERPARAMETERS_PATH's file, which the
    ranks read after the tool has become the command: two runs of one YAML share one file with its content (runs
    leave no pile of them in the temp folder), other parameters get a file of their own, and so do parameters whose
    file name another user's file (here a folder) has taken."""
    workload, tool = (
        tmp_path / "cat.yaml",
        [sys.executable, str(ROOT / "tools/run_workload.py"), str(tmp_path / "cat.yaml")],
    )
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()

    def run(parameters: dict) -> list[str]:  # the temp folder's files after the run
        spec = {"code_source": {"root_path": "."}, "parameters": parameters, "command": 'cat "$HYPERPARAMETERS_PATH"'}
        workload.write_text(yaml.safe_dump(spec))
        proc = subprocess.run(tool, capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 0 and yaml.safe_load(proc.stdout) == parameters, proc.stdout + proc.stderr
        return sorted(p.name for p in (tmp_path / "tmp").iterdir())

    files = [run({"max_steps": 20}), run({"max_steps": 20}), run({"max_steps": 30})]
    assert len(files[0]) == 1 and files[1] == files[0], files
    assert len(files[2]) == 2 and set(files[0]) < set(files[2]), files
    parameters = {"max_steps": 40}  # its file's name taken by something the tool cannot replace: a file of its own
    digest = hashlib.sha256(yaml.safe_dump(parameters).encode()).hexdigest()[:16]
    (tmp_path / "tmp" / f"hyperparameters-{os.getuid()}-{digest}.yaml").mkdir()
    run(parameters)


UNREACHABLE_HOSTNAME = 'import socket\nsocket.getfqdn = lambda name="": "0-unreachable.invalid"\n'


@pytest.mark.distributed
@pytest.mark.parametrize("path", WORKLOADS, ids=lambda p: p.name)
def test_two_nodes_meet_at_addresses_they_reach_whatever_their_host_names(path, tiny_model_dir, tmp_path):
    """Each workload's command on two nodes of this machine (NODE_RANK 0 and 1, one CPU rank each, the
    node setup a dry run). torchrun's c10d rendezvous ranks the nodes by their addresses (the host name where none is
    given) and its rank 0 hosts each attempt's store at its own: node 1's host name is made one that sorts first and
    that no one can resolve, as a container's may be. The command gives each node an address node 0 reaches (the
    one its traffic to MASTER_ADDR leaves from), so the job still trains."""
    command, env = node_command(path, tiny_model_dir, tmp_path, LOCAL_WORLD_SIZE="1", NUM_NODES="2")
    env["MASTER_ADDR"] = "127.0.0.1"
    (names := tmp_path / "names").mkdir()
    (names / "sitecustomize.py").write_text(UNREACHABLE_HOSTNAME)
    node_1_env = {**env, "NODE_RANK": "1", "PYTHONPATH": os.pathsep.join([str(names), env.get("PYTHONPATH", "")])}
    node_1 = subprocess.Popen(command, cwd=tmp_path, env=node_1_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        node_0 = run_process(command, cwd=tmp_path, env={**env, "NODE_RANK": "0"}, timeout=240)
        output_1 = node_1.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        node_1.kill()
    output = node_0.stdout + node_0.stderr + output_1
    assert node_0.returncode == 0 and node_1.returncode == 0, output[-4000:]
    assert "world_size 2" in output and "step 3/3" in output and (tmp_path / "out/model/config.json").exists()


def test_the_kernel_cache_is_on_the_volume_and_left_to_triton_where_there_is_none(tmp_path, monkeypatch):
    from run_workload import command_env

    path = ROOT / "workload.yaml"
    w = yaml.safe_load(path.read_text())
    volume = w["env_variables"]["KERNEL_CACHE"]
    assert volume.startswith("/Volumes/") and volume.split("/")[:5] == w["parameters"]["output_dir"].split("/")[:5]
    monkeypatch.delenv("KERNEL_CACHE", raising=False)
    if not Path(volume).parent.exists():  # no such volume here
        assert "KERNEL_CACHE" not in command_env(w, path, tmp_path / "p.yaml", False, True, [])
    w["env_variables"]["KERNEL_CACHE"] = here = str(tmp_path / "kernel-cache")
    assert command_env(w, path, tmp_path / "p.yaml", False, True, [])["KERNEL_CACHE"] == here
    monkeypatch.setenv("KERNEL_CACHE", "/Volumes/yours/kernels")  # yours wins, mounted or not
    assert command_env(w, path, tmp_path / "p.yaml", False, True, [])["KERNEL_CACHE"] == "/Volumes/yours/kernels"


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
    proc = run_process([*TORCHRUN, "train.py", "--config", str(config)], cwd=ROOT, env=env, timeout=300)
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


@pytest.fixture()
def callers_world(tmp_path):
    """A process group a notebook made itself (gloo, this process alone), as train() finds it there; the number of
    groups in the process before train()."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield len(dist.distributed_c10d._world.pg_map)
    dist.destroy_process_group()


def test_train_in_a_callers_process_group_leaves_the_process_the_groups_it_had(tiny_model_dir, tmp_path, callers_world):
    """A notebook that made its own process group keeps it through train(), and what train() made there (the host's
    group, the checkpoints' group) goes: two calls in one process, each saving a checkpoint, leave the groups as
    they were."""
    import torch.distributed as dist

    for name in ("first", "second"):
        settings = dict(max_steps=1, save_every=1, export=False, output_dir=str(tmp_path / name))
        assert train.train(str(write_tiny_job(tmp_path / f"{name}.yaml", tiny_model_dir, **settings)))["steps"] == 1
        assert (tmp_path / name / "checkpoints/step_00000001/complete.json").exists()
        assert dist.is_initialized() and len(dist.distributed_c10d._world.pg_map) == callers_world


def test_an_exception_with_a_checkpoint_in_flight_leaves_the_one_before_it_to_resume(
    tiny_model_dir, tmp_path, callers_world, capsys
):
    """In a notebook's process, an exception in step 5 while step 4's background write is in flight: train() raises
    it without waiting for that write (its checkpoint has no complete.json), and the next call resumes from step 2's
    and trains to the end, step 4's save written again. (Under capsys, as under a notebook stream with no file
    descriptor: the stack dumps go to the process's own stderr.)"""
    import torch.distributed as dist

    def fails_at_step_5(step, *_):
        if step == 5:
            raise RuntimeError("a fault in step 5")

    out = tmp_path / "out"
    settings = dict(max_steps=6, save_every=2, keep_checkpoints=3, export=False, output_dir=str(out))
    job, cfg = str(write_tiny_job(tmp_path / "job.yaml", tiny_model_dir, **settings)), train.Config(output_dir=str(out))
    with pytest.raises(RuntimeError, match="a fault in step 5"):
        train.train(job, step_hook=fails_at_step_5)
    assert [p.name for p in train.complete_checkpoints(cfg)] == ["step_00000002"]
    assert (out / "checkpoints/step_00000004").is_dir()
    assert len(dist.distributed_c10d._world.pg_map) == callers_world
    capsys.readouterr()
    assert train.train(job)["steps"] == 6
    assert f"resumed from {out / 'checkpoints/step_00000002'} (step 2 of 6)" in capsys.readouterr().out
    assert [p.name for p in train.complete_checkpoints(cfg)] == ["step_00000002", "step_00000004", "step_00000006"]
    assert json.loads((out / "checkpoints/step_00000004/complete.json").read_text())["step"] == 4


@pytest.mark.distributed
def test_notebook_entry_point_runs_in_processes_started_like_the_decorator(tiny_model_dir, tmp_path):
    """@distributed starts one process per GPU with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_* set, and calls the
    function there: no torchrun."""
    config = yaml.safe_load(tiny_override(tmp_path, tiny_model_dir).read_text())
    call = "import json, os, sys, train; print('RESULT', json.dumps(train.train(json.loads(sys.argv[1]))), flush=True)"
    call += "; os._exit(0)"  # as main() leaves: the interpreter's teardown can abort a finished rank (gloo's threads)
    port = str(free_port())
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
    # The eval loss is the token mean over both ranks' held-out blocks, recomputed here on the exported weights
    cfg = train.load_config(("test", config))
    model, blocks = (
        demo.load_model(Path(results[0]["model_dir"]), cfg),
        demo.eval_blocks(cfg, train.load_tokenizer(cfg), 2),
    )
    assert len(blocks) == 2 and blocks[0]["loss_tokens"] != blocks[1]["loss_tokens"]  # a mean of means would differ
    assert demo.heldout_loss(model, blocks, cfg) == pytest.approx(results[0]["eval_loss"], rel=1e-5)
