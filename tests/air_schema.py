"""Checks a `databricks air run` YAML as the newest Go code in databricks/cli cmd/air/ does: runconfig.go @51326a11
(schema as @df4dca8d: flat code_source + hidden legacy `snapshot`, containers), runconfig_load.go @560e9091 (yaml.v3
KnownFields(true), explicit null type/snapshot kept, validateRuntimeVersion), compute.go @e7083e1e (GPU_8xB300, pool_id,
priority_class), snapshot.go @51326a11 + snapshot_upload.go @365d7014 (resolveRootPath against the YAML's folder).
Go stops at the first error; this collects all. PyYAML reads YAML 1.1, yaml.v3 YAML 1.2: a few scalars differ (see
comments), and duplicate keys (a yaml.v3 error) cannot be seen in a dict.
"""

import json
import re
from pathlib import Path

from run_workload import resolve_root_path  # tools/: the tool resolves root_path as the CLI does

ACCELERATORS: dict[str, int] = {"GPU_1xA10": 1, "GPU_1xH100": 1, "GPU_8xH100": 8, "GPU_8xB300": 8}
PRIORITY_CLASSES = ("BEST_EFFORT", "NORMAL", "CRITICAL")
SNAPSHOT = {"root_path", "remote_volume", "git", "include_paths"}  # codeSourceConfig.Snapshot is `yaml:",inline"`
KEYS = {  # the yaml tags of each Go struct; KnownFields(true) rejects any other key
    "config": set(
        "experiment_name compute environment command containers env_variables secrets code_source max_retries"
        " timeout_minutes idempotency_token parameters mlflow_run_name mlflow_experiment_directory"
        " mlflow_artifact_location permissions usage_policy_name usage_policy_id".split()
    ),
    "compute": {"num_accelerators", "accelerator_type", "pool_id", "priority_class"},
    "environment": {"dependencies", "version", "unity_catalog_image"},
    "code_source": SNAPSHOT | {"type", "snapshot"},
    "git": {"branch", "commit", "remote"},
    "permission": {"user_name", "group_name", "service_principal_name", "level"},
    "container": {"name", "command", "ranks", "unity_catalog_image", "environment_variables"},
    "container_env": {"variables", "files"},
    "snapshot": SNAPSHOT,
}
# RE2's `$` is end of text and its \w \s are ASCII: hence fullmatch and re.ASCII.
TASK_KEY, GIT_REF = re.compile(r"[A-Za-z0-9_-]+"), re.compile(r"[\w./-]+", re.ASCII)
UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
UC_IMAGE = re.compile(r"[^.:\s]+\.[^.:\s]+\.[^.:\s]+:[^:\s]+", re.ASCII)
CONTAINER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,15}")
SECRET_TEMPLATE = re.compile(r"\{\{secrets/[^/{}]+/[^/{}]+\}\}")
q = json.dumps  # close to Go's %q


def nbytes(s):  # Go's len() counts bytes
    return len(s.encode())


class _Checker:
    def __init__(self):
        self.problems: list[str] = []

    def err(self, msg):
        self.problems.append(msg)

    def keys(self, m, kind, where):
        self.problems += [f"{where}: field {k} not found (unknown key)" for k in m if str(k) not in KEYS[kind]]

    def typed(self, v, kind, where):  # absent or null -> None, like a nil pointer/map/slice
        if v is None or isinstance(v, kind):
            return v
        self.err(f"{where}: cannot decode {type(v).__name__} {v!r} into a {kind.__name__}")

    def str(self, v, where):
        # yaml.v3 stores any scalar's source text in a Go string (8 -> "8", true -> "true"); null leaves it unset.
        # PyYAML has converted the scalar already: str() is the closest text (1.0e-5 comes back as "1e-05").
        if v is None or isinstance(v, (dict, list)):
            return None if v is None else self.typed(v, str, where)
        return ("true" if v else "false") if isinstance(v, bool) else str(v)

    def int(self, v, where):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):  # a quoted "8" is a !!str
            return self.err(f"{where}: cannot decode {v!r} into an int")
        return None if v is None else int(v)  # yaml.v3 truncates a float decoded into an int

    def strmap(self, v, where):  # map[string]string: values as text, null -> ""; a nested value is a decode error
        m = self.typed(v, dict, where) or {}
        ok = {k: x for k, x in m.items() if not isinstance(x, (dict, list)) or self.typed(x, str, f"{where}.{k}")}
        return {str(k): self.str(x, where) or "" for k, x in ok.items()}

    def command(self, cmd, where):
        if cmd is None or not cmd.strip() or cmd.count("\n") >= 1000:
            self.err(f"{where} is required, must not be blank, and may have at most 1000 lines")

    def trimmed(self, doc, key, limit=0):  # optional *string: trimmed, not empty, at most `limit` bytes
        v = None if (v := self.str(doc.get(key), key)) is None else v.strip()
        if v is not None and (not v or limit and nbytes(v) > limit):
            self.err(f"{key} must not be empty" + (f" or longer than {limit} characters" if limit else ""))
        return v


def validate(doc: dict, yaml_dir: Path) -> list[str]:
    if not isinstance(doc, dict):
        return ["config is empty" if doc is None else "invalid config: the document is not a mapping"]
    c = _Checker()
    c.keys(doc, "config", "config")
    name = c.str(doc.get("experiment_name"), "experiment_name") or ""
    if not name or nbytes(name) > 100 or not TASK_KEY.fullmatch(name):
        c.err(f"experiment_name {q(name)}: 1-100 characters, only alphanumerics, hyphens, and underscores")
    compute = c.typed(doc.get("compute"), dict, "compute")
    nodes = _compute(c, compute) if compute is not None else c.err("compute: section is required")
    env = c.typed(doc.get("environment"), dict, "environment")
    image = _environment(c, env) if env is not None else ""
    cmd, containers = c.str(doc.get("command"), "command"), c.typed(doc.get("containers"), list, "containers")
    if (cmd is None) == (not containers):
        c.err("exactly one of command and containers must be set")
    elif cmd is not None:
        c.command(cmd, "command")
    elif image:
        c.err("environment.unity_catalog_image cannot be used with containers; set it on every container")
    elif nodes:
        _containers(c, containers, nodes)
    env_vars, secrets = c.strmap(doc.get("env_variables"), "env_variables"), c.strmap(doc.get("secrets"), "secrets")
    for var, ref in secrets.items():  # validateSecretRefs: exactly one "/", with neither side empty
        if len(ref.split("/")) != 2 or "" in ref.split("/"):
            c.err(f"invalid secret reference {q(ref)} for variable {q(var)}: expected format 'scope/key'")
    c.problems += [f"{q(v)} is set in both env_variables and secrets" for v in sorted(set(env_vars) & set(secrets))]
    if (code_source := c.typed(doc.get("code_source"), dict, "code_source")) is not None:
        _code_source(c, code_source, Path(yaml_dir))
    for key, low in (("max_retries", 0), ("timeout_minutes", 1)):
        if (n := c.int(doc.get(key), key)) is not None and n < low:
            c.err(f"{key} must be >= {low}, got {n}")
    c.trimmed(doc, "idempotency_token", 64)
    if (run := c.trimmed(doc, "mlflow_run_name", 100)) and nbytes(run) <= 100 and not TASK_KEY.fullmatch(run):
        c.err(f"invalid mlflow_run_name {q(run)}: only alphanumerics, hyphens, and underscores are allowed")
    if (exp_dir := c.trimmed(doc, "mlflow_experiment_directory")) and not exp_dir.startswith("/Workspace"):
        c.err(f"mlflow_experiment_directory must start with '/Workspace', got: {exp_dir}")
    if (loc := c.trimmed(doc, "mlflow_artifact_location")) and not loc.startswith(("dbfs:/", "/Volumes/")):
        c.err(f"mlflow_artifact_location must be a dbfs: URI, got: {loc}")  # /Volumes/x is taken as dbfs:/Volumes/x
    c.typed(doc.get("parameters"), dict, "parameters")  # map[string]any: any nested values
    for i, p in enumerate(c.typed(doc.get("permissions"), list, "permissions") or []):
        if (p := c.typed(p, dict, where := f"permissions[{i}]")) is None:
            continue  # yaml.v3 drops a null list element
        c.keys(p, "permission", where)
        given = [k for k in ("user_name", "group_name", "service_principal_name") if p.get(k) is not None]
        if len(given) != 1 or not (c.str(p[given[0]], where) or "").strip():
            c.err(f"{where}: exactly one non-empty user_name, group_name, or service_principal_name is required")
        if not (c.str(p.get("level"), f"{where}.level") or "").strip():
            c.err(f"{where}: 'level' is required")
    if doc.get("usage_policy_name") is not None and doc.get("usage_policy_id") is not None:
        c.err("usage_policy_name and usage_policy_id are mutually exclusive; set only one")
    c.trimmed(doc, "usage_policy_name", 127)
    if (policy := c.trimmed(doc, "usage_policy_id")) and not UUID.fullmatch(policy):
        c.err(f"usage_policy_id must be a UUID, got: {policy}")
    return c.problems


def _compute(c, m):  # returns the node count when accelerator_type and num_accelerators are valid
    c.keys(m, "compute", "compute")
    acc = c.str(m.get("accelerator_type"), "compute.accelerator_type") or ""  # matched case-sensitively
    n, per = c.int(m.get("num_accelerators"), "compute.num_accelerators") or 0, ACCELERATORS.get(acc)
    if per is None:
        c.err(f"compute.accelerator_type: invalid GPU type {q(acc)}: valid types are: {', '.join(ACCELERATORS)}")
    elif n <= 0 or n % per:
        c.err(f"compute.num_accelerators for {acc} must be a positive multiple of {per}, got {n}")
    if (pool := c.str(m.get("pool_id"), "compute.pool_id")) is not None and not 0 < nbytes(pool.strip()) <= 255:
        c.err(f"compute.pool_id must be 1-255 characters after trimming, got {q(pool)}")
    prio = c.str(m.get("priority_class"), "compute.priority_class")
    if prio is not None and prio.strip().upper() not in PRIORITY_CLASSES:  # trimmed, case-insensitive
        c.err(f"compute.priority_class: invalid {q(prio)}: valid values are: {', '.join(PRIORITY_CLASSES)}")
    elif prio is not None and m.get("pool_id") is None:
        c.err("compute.priority_class requires compute.pool_id")
    return n // per if per and n > 0 and not n % per else None


def _environment(c, m):
    c.keys(m, "environment", "environment")
    deps, version = m.get("dependencies"), m.get("version")  # a null leaves either one unset
    if deps is not None and not isinstance(deps, list):
        c.err("environment.dependencies must be a list of packages (a direct file reference is not supported)")
    for i, dep in enumerate(deps if isinstance(deps, list) else []):
        c.str(dep, f"environment.dependencies[{i}]")
    if isinstance(version, (dict, list)):
        version = c.err("environment.version must be a string or integer")
    image = c.str(m.get("unity_catalog_image"), "environment.unity_catalog_image") or ""
    clash = [k for k, v in (("dependencies", isinstance(deps, list)), ("version", version is not None)) if v]
    if image and not UC_IMAGE.fullmatch(image):
        c.err(f"environment.unity_catalog_image must be '<catalog>.<schema>.<image>:<tag>', got {q(image)}")
    elif image and clash:
        c.err(f"when 'unity_catalog_image' is specified under 'environment', these are not allowed: {', '.join(clash)}")
    elif not image and version is not None:  # validateRuntimeVersion: an integer, or databricks_ai_v<N> with N >= 5
        raw = c.str(version, "environment.version")
        num = raw.lower().removeprefix("databricks_ai_v")
        if not re.fullmatch(r"[0-9]+", num) or raw.lower().startswith("databricks_ai_v") and int(num) < 5:
            c.err(f"unsupported environment.version {q(raw)}: an integer, or databricks_ai_v<N> with N >= 5")
    return image


def _containers(c, items, nodes):  # runConfig.validateContainers
    owners, names = [None] * nodes, set()
    for i, m in enumerate(items):
        if (m := c.typed(m, dict, pre := f"containers[{i}]")) is None:
            continue  # yaml.v3 drops a null list element
        c.keys(m, "container", pre)
        if not CONTAINER_NAME.fullmatch(name := c.str(m.get("name"), pre) or "") or name in names:
            c.err(f"{pre}.name {q(name)}: unique, at most 16 letters, digits, underscores, not starting with a digit")
        names.add(name)
        c.command(c.str(m.get("command"), f"{pre}.command"), f"{pre}.command")
        ranks = [c.int(r, pre) for r in c.typed(m.get("ranks"), list, f"{pre}.ranks") or [] if r is not None]
        if not (ranks := [r for r in ranks if r is not None]):
            c.err(f"{pre}.ranks must contain at least one rank")
        if not UC_IMAGE.fullmatch(c.str(m.get("unity_catalog_image"), pre) or ""):
            c.err(f"{pre}.unity_catalog_image must be '<catalog>.<schema>.<image>:<tag>'")
        if (ev := c.typed(m.get("environment_variables"), dict, f"{pre}.environment_variables")) is not None:
            c.keys(ev, "container_env", f"{pre}.environment_variables")
            if c.typed(ev.get("files"), list, pre):
                c.err(f"{pre}.environment_variables.files is not supported; use environment_variables.variables")
            for k, val in c.strmap(ev.get("variables"), f"{pre}.environment_variables.variables").items():
                if val.startswith("{{secrets/") and not SECRET_TEMPLATE.fullmatch(val):
                    c.err(f"{pre}.environment_variables.variables.{k}: expected {{{{secrets/<scope>/<key>}}}}")
        for r in ranks:
            if not 0 <= r < nodes or owners[r] is not None:
                c.err(f"{pre}.ranks: rank {r} is outside 0..{nodes - 1} or already assigned to another container")
            else:
                owners[r] = name
    c.problems += [f"rank {r} is not assigned to a container" for r, o in enumerate(owners) if o is None]


def _snapshot_block(cs):  # (fields, prefix) the Go code would validate, or None
    if flat := {k: cs[k] for k in SNAPSHOT if k in cs}:  # any inline key allocates the inline *snapshotSourceConfig
        return flat, "code_source"
    if "snapshot" in cs:  # finishRunConfigLoad keeps an explicit `snapshot: null` as an empty block
        return {} if cs["snapshot"] is None else cs["snapshot"], "code_source.snapshot"


def _code_source(c, cs, yaml_dir):
    c.keys(cs, "code_source", "code_source")
    if "type" in cs:  # finishRunConfigLoad keeps an explicit `type: null` as ""
        if (kind := "" if cs["type"] is None else c.str(cs["type"], "code_source.type")) not in (None, "snapshot"):
            c.err(f"code_source.type must be 'snapshot' (or omitted), got {q(kind)}")
    if any(k in cs for k in SNAPSHOT) and "snapshot" in cs:
        return c.err("code_source cannot combine the nested 'snapshot' block with direct fields")
    if (block := _snapshot_block(cs)) is None:
        return c.err("code_source requires snapshot configuration with root_path")
    if (snap := c.typed(block[0], dict, pre := block[1])) is None:
        return
    c.keys(snap, "snapshot", pre)
    if not (root := c.str(snap.get("root_path"), f"{pre}.root_path") or "").strip():
        c.err(f"{pre}.root_path cannot be empty")
    if (vol := c.str(snap.get("remote_volume"), pre)) is not None and not vol.startswith("/Volumes/"):
        c.err(f"{pre}.remote_volume must start with '/Volumes/'")
    if (include := c.typed(snap.get("include_paths"), list, f"{pre}.include_paths")) == []:
        c.err(f"{pre}.include_paths cannot be an empty list; either omit it or provide paths")
    for p in ((c.str(p, f"{pre}.include_paths") or "").strip() for p in include or [] if p is not None):
        if not p or p.startswith("/") or ".." in p.split("/"):
            c.err(f"{pre}.include_paths entries must be non-empty relative paths without '..', got: {q(p)}")
    if (git := c.typed(snap.get("git"), dict, f"{pre}.git")) is not None:
        c.keys(git, "git", f"{pre}.git")
        branch, commit, remote = (git.get(k) for k in ("branch", "commit", "remote"))
        if branch is not None and not GIT_REF.fullmatch(c.str(branch, "git.branch") or ""):
            c.err(f"invalid git.branch format {q(str(branch))}: only alphanumerics and - . / _ are allowed")
        # gitRemote: a !!bool is itself, any other scalar a remote name (truthy when non-empty). PyYAML reads `no`
        # and `off` as False where yaml.v3 reads the name "no" (truthy, so rejected): that one case passes here.
        if remote is True or not isinstance(remote, (bool, type(None))) and str(remote) != "":
            c.err("git.remote is no longer supported (only false); use git.commit to pin a revision")
        if (branch is None) == (commit is None):
            c.err("git: specify exactly one of 'branch' or 'commit'")
    # Go checks this at upload (uploadSnapshot -> resolveRootPath), after validate(). Its launch-time git checks
    # (a repository, the commit present locally, a clean tree for a branch) are not mirrored.
    if root.strip():
        path = resolve_root_path(root, yaml_dir)
        if not path.is_dir():
            c.err(f"root_path must be a directory: {path}" if path.exists() else f"root_path does not exist: {path}")


def code_source_root(doc: dict, yaml_path: Path) -> Path:
    """The folder `air run` would archive, for either code_source form (the flat one when both are given)."""
    block = _snapshot_block(cs) if isinstance(cs := (doc or {}).get("code_source"), dict) else None
    root = block[0].get("root_path") if block and isinstance(block[0], dict) else None
    if root is None or not str(root).strip():
        raise ValueError("config has no code_source root_path")
    return resolve_root_path(str(root), Path(yaml_path).parent)
