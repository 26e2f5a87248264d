#!/usr/bin/env python3
"""Runs a workload YAML's command on this machine as Databricks AI Runtime runs it on a node, so that your own GPUs
get the same node setup and launch, from the same lines: the YAML's env_variables exported (a variable your
environment already sets wins), its parameters written to the file $HYPERPARAMETERS_PATH names, $CODE_SOURCE_PATH
at its code_source root_path (read in place, not copied), then `bash -c` its command. Secrets (HF_TOKEN) come from
your environment.

    python tools/run_workload.py workload.yaml                        # set this machine up, then train
    python tools/run_workload.py workload.yaml --setup-only           # the node setup alone
    python tools/run_workload.py workload.yaml --setup-only --dry-run # up to the CUDA compile; installs nothing
    python tools/run_workload.py workload.yaml -- --max_steps 20 --output_dir /data/sft   # train.py flags

The command's torchrun takes NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT and LOCAL_WORLD_SIZE from the environment
(one node of 8 GPUs by default): LOCAL_WORLD_SIZE=4 python tools/run_workload.py workload.yaml.
"""

import argparse
import hashlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

ENV_REF = re.compile(r"\$(?:\{([^}]*)\}|([*#$@!?0-9-]|[A-Za-z_][A-Za-z0-9_]*))")  # Go's os.ExpandEnv syntax


def resolve_root_path(raw: str, yaml_dir: Path) -> Path:
    """root_path as `databricks air run` resolves it (resolveRootPath): $VARS expanded (an unset one to ""), `~`
    from $HOME, a leading project_root/ stripped, a relative path joined to the YAML's folder, made absolute
    lexically (symlinks kept)."""

    def join(a, b):  # Go's filepath.Join: joins and cleans; a leading "/" in b does not restart the path
        return os.path.normpath(f"{a}/{b}")

    s = ENV_REF.sub(lambda m: os.environ.get(m.group(1) if m.group(1) is not None else m.group(2), ""), raw)
    if (home := os.environ.get("HOME")) and (s == "~" or s.startswith("~/")):
        s = join(home, s[2:])
    if s.startswith("project_root/") or not os.path.isabs(s):
        s = join(yaml_dir, s.removeprefix("project_root/"))
    return Path(os.path.abspath(s))


def code_source_root(workload: dict, path: Path) -> Path:
    """The folder the platform uploads: code_source's root_path (the flat form, or the legacy nested one)."""
    source = workload.get("code_source") or {}
    root = source.get("root_path") or (source.get("snapshot") or {}).get("root_path")
    if not root:
        sys.exit(f"{path}: code_source has no root_path")
    return resolve_root_path(str(root), path.parent)


def volume_not_here(env: dict, name: str) -> bool:
    """The YAML's value of name (not yours) is a path whose folder, a volume's, this machine does not have."""
    value = env.get(name)
    return bool(value) and name not in os.environ and not Path(value).parent.exists()


def command_env(workload: dict, path: Path, params_file: Path, setup_only: bool, dry_run: bool, train_args) -> dict:
    """The environment the command runs in."""
    env = {k: str(v) for k, v in (workload.get("env_variables") or {}).items()} | dict(os.environ)
    env |= {"CODE_SOURCE_PATH": str(code_source_root(workload, path)), "HYPERPARAMETERS_PATH": str(params_file)}
    env |= {"SETUP_ONLY": "1"} if setup_only else {}
    env |= {"NODE_SETUP_DRY_RUN": "1"} if dry_run else {}
    env |= {"TRAIN_ARGS": " ".join(train_args)} if train_args else {}
    if not dry_run and volume_not_here(env, "WHEEL_CACHE"):
        sys.exit(
            f"{path} caches the kernels it builds in WHEEL_CACHE={env['WHEEL_CACHE']}, which is not on this machine: "
            "set WHEEL_CACHE to a folder of yours (WHEEL_CACHE=~/.cache/sft-wheels)"
        )
    if volume_not_here(env, "KERNEL_CACHE"):  # here, Triton's own cache (~/.triton) serves
        del env["KERNEL_CACHE"]
    for name in workload.get("secrets") or {}:
        if name not in env:
            print(f"run_workload: the workload reads the secret {name}; it is not set here", file=sys.stderr)
    return env


def parameters_file(text: str) -> Path:
    """The parameters block as the file $HYPERPARAMETERS_PATH names, in the temp folder. The ranks read it after this
    process has become the command (exec), so nothing is left to delete it: one file per content and user, which a run
    with the same parameters writes again, keeps them from piling up. Written aside, then renamed into place."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"hyperparameters-{os.getuid()}-{digest}.yaml"
    handle, aside = tempfile.mkstemp(prefix=f"{path.stem}-", suffix=".tmp", dir=path.parent)
    try:
        os.write(handle, text.encode())
    except OSError:
        os.unlink(aside)
        raise
    finally:
        os.close(handle)
    try:
        os.replace(aside, path)
    except OSError:  # the name is taken by something this user cannot replace: this run's own file serves
        return Path(aside)
    return path


def main() -> None:
    usage = "run_workload.py WORKLOAD [--setup-only] [--dry-run] [-- TRAIN.PY FLAGS]"
    parser = argparse.ArgumentParser(usage=usage, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("workload", type=Path, help="the workload YAML (workload.yaml)")
    parser.add_argument("--setup-only", action="store_true", help="stop after the node setup")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="node setup up to the CUDA compile, installing nothing (then torchrun, unless --setup-only)",
    )
    argv = sys.argv[1:]
    ours, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    if altered := [arg for arg in train_args if not arg or re.search(r"[\s*?\[]", arg)]:  # as TRAIN_ARGS on a node
        sys.exit(
            f"run_workload: the command expands TRAIN_ARGS unquoted, so {altered[0]!r} would not reach train.py as "
            "typed (split at spaces, globbed, or gone): write an empty value as --key= and give the others in a "
            "--config file"
        )
    workload = yaml.safe_load(args.workload.read_text())
    params = parameters_file(yaml.safe_dump(workload.get("parameters") or {}))
    env = command_env(workload, args.workload, params, args.setup_only, args.dry_run, train_args)
    sys.stdout.flush()
    # exec: the command (and the torchrun it execs) is this process, and gets its signals, as on a node.
    os.execve(shutil.which("bash"), ["bash", "-c", workload["command"]], env)


if __name__ == "__main__":
    main()
