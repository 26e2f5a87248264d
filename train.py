#!/usr/bin/env python3
"""Supervised fine-tuning of a causal LM with plain PyTorch FSDP2: one file, launched by torchrun.

Default job: Qwen/Qwen3.8-27B (model_type qwen3_5, a hybrid of Gated DeltaNet linear-attention layers and a
gated full-attention layer every fourth layer) on UltraChat 200k `train_sft`, one pass, 32,768-token packed
blocks, loss on assistant tokens only, one 8xB300 node.

The file runs these phases, in this order:
  1. configuration  one dataclass (default, doc, check, resume policy per field); overrides from
                    $HYPERPARAMETERS_PATH, then --config FILE.yaml, then --key value (or train(dict))
  2. distributed    rank / local rank / world size from the environment (torchrun or a notebook decorator)
  3. data           read this rank's shard -> render the chat template -> mask all but assistant turns ->
                    pack whole conversations into blocks (best-fit decreasing) -> block-diagonal signals;
                    the counting pass that fixes the step count
  4. model          build on the meta device, use_cache=False, activation checkpointing, fully_shard each
                    decoder layer then the root, each rank reads its own slices of the safetensors checkpoint
  5. training       a step: global token-mean loss over ranks and micro-steps, clipping, AdamW, warmup + decay,
                    non-finite steps skipped on every rank together; the loop logs, evaluates and saves
  6. checkpoints    sharded DCP checkpoints with each rank's data position; automatic resume; the final
                    consolidated Hugging Face export to output_dir/model
  7. entry points   train(config) for notebooks and torchrun, main()

Launch:
  GPU node:   torchrun --nproc_per_node=8 train.py                       (the default job)
  multi-node: torchrun --nnodes=$NUM_NODES --node_rank=$NODE_RANK --nproc_per_node=8 \\
                       --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT train.py --config job.yaml
  CPU smoke:  torchrun --nproc_per_node=2 train.py --config examples/cpu_smoke.yaml
  look at the data only (tokenizer needed, no weights): python tools/inspect_data.py 2 [the same flags]
  every setting: python train.py --help
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import hashlib
import importlib.util
import itertools
import json
import math
import os
import random
import resource
import shutil
import signal
import socket
import sys
import threading
import time
import weakref
import zlib
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.staging import AsyncStager
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

# ------------------------------------------------------------------------------------------------------------
# 1. Configuration
# ------------------------------------------------------------------------------------------------------------


class UserError(ValueError):
    """A problem with the job's settings, data, files or environment, for the user to fix: main() prints it as one
    line from rank 0 and exits with status 2. Anything else is a bug and keeps its traceback."""


ATTENTION_BACKENDS = ("auto", "flash_attention_2", "torch_varlen", "sdpa", "eager")


def setting(default, doc: str, check: tuple | None = None, resumable: bool = False):
    """A Config field: its default, the doc --help prints, an optional check (a predicate, what it requires), and
    whether a resumed run may change it (else the checkpoint's data positions, schedule and optimizer need it)."""
    return dataclasses.field(default=default, metadata={"doc": doc, "check": check, "resumable": resumable})


def one_of(*choices) -> tuple:
    return (lambda v: v in choices, f"one of {', '.join(choices)}")


AT_LEAST_1, AT_LEAST_0, AT_LEAST_MINUS_1 = ((lambda v, n=n: v >= n, f">= {n}") for n in (1, 0, -1))
FRACTION, BETA = (lambda v: 0 <= v <= 1, "in [0, 1]"), (lambda v: 0 <= v < 1, "in [0, 1)")
DTYPES = one_of("bfloat16", "float32")


def recompute_share(value: str) -> float | None:
    """activation_checkpointing as a share of the layers to recompute; None for auto (RecomputeProbe)."""
    return None if value == "auto" else float(value)


def is_recompute_setting(value: str) -> bool:
    try:
        return value == "auto" or 0 <= float(value) <= 1
    except ValueError:
        return False


@dataclass(frozen=True)
class Config:
    """Every setting of a run, with the default job's values. Checked on construction, however it is built."""

    # Model. Revisions are pinned so runs stay comparable as hub repos move ("" = latest).
    model_name: str = setting("Qwen/Qwen3.8-27B", "hub name or local directory")
    model_revision: str = setting(
        "1d4bf0f2ff6012fd82039f2fa52739d0dd7c60c0", "hub revision (the tokenizer's too, without tokenizer_name)"
    )
    tokenizer_name: str = setting("", "tokenizer (and chat template) to use; empty: model_name's")
    trust_remote_code: bool = setting(False, "run Python code a hub repo ships (repos you trust)", resumable=True)
    init: str = setting("pretrained", "pretrained weights, or random (benchmarks)", one_of("pretrained", "random"))
    attn_implementation: str = setting("auto", "attention kernel", one_of(*ATTENTION_BACKENDS), resumable=True)
    master_dtype: str = setting("float32", "weights and AdamW state; bfloat16 halves them (the seed's)", DTYPES)
    param_dtype: str = setting("bfloat16", "compute dtype of FSDP's all-gathered parameters", DTYPES, resumable=True)
    reduce_dtype: str = setting("float32", "dtype gradients are reduce-scattered over ranks in", DTYPES, resumable=True)
    activation_checkpointing: str = setting(
        "auto",
        "share of decoder layers recomputed in backward; auto: on GPUs, keep the activations of as many layers as "
        "the memory left after the second step holds, the most time saved per GiB first (1.0 elsewhere)",
        (is_recompute_setting, "auto, or a share in [0, 1]"),
        resumable=True,
    )
    compile: bool = setting(True, "torch.compile the decoder layers' norms and MLPs (off for CPU runs)", resumable=True)
    float8: bool = setting(
        False, "the decoder MLPs' matmuls in float8, rowwise scaled (torchao; Hopper or newer)", resumable=True
    )
    # Data: a hub dataset (streamed) or a local .jsonl / .json / .parquet file.
    dataset_name: str = setting("HuggingFaceH4/ultrachat_200k", "hub dataset or local .jsonl/.json/.parquet file")
    dataset_revision: str = setting("8049631c405ae6576f93f445c6b8166f76f5505a", "hub dataset revision")
    dataset_split: str = setting("train_sft", "split of dataset_name to train on")
    messages_column: str = setting("messages", "column holding the conversations (role/content messages)")
    tools_column: str = setting("tools", "column holding the tool definitions the chat template is given, if any")
    reasoning: str = setting(
        "train", "assistant reasoning: trained with its answer, or dropped", one_of("train", "drop")
    )
    eval_split: str = setting("", "held-out split of dataset_name, or a local file; empty: none", resumable=True)
    eval_fraction: float = setting(0.0, "share of the records held out (seeded), never trained, for eval", FRACTION)
    eval_blocks: int = setting(8, "eval blocks per rank", AT_LEAST_1, resumable=True)
    max_seq_len: int = setting(32768, "tokens per packed block", (lambda v: v >= 16, ">= 16"))
    pack_buffer_blocks: int = setting(64, "best-fit decreasing packs this many blocks' worth at a time", AT_LEAST_1)
    num_workers: int = setting(1, "DataLoader worker processes per rank (0: pack in the training process)", AT_LEAST_0)
    max_skip_fraction: float = setting(0.2, "stop when more records than this are skipped", FRACTION, resumable=True)
    # Optimisation. One optimizer step = gradient_accumulation_steps blocks on every rank.
    learning_rate: float = setting(1e-5, "peak learning rate", (lambda v: 0 < v < math.inf, "> 0 and finite"))
    adam_beta1: float = setting(0.9, "AdamW beta1", BETA)
    adam_beta2: float = setting(0.95, "AdamW beta2", BETA)
    weight_decay: float = setting(0.0, "AdamW weight decay", AT_LEAST_0)
    max_grad_norm: float = setting(1.0, "gradient clipping norm", (lambda v: v > 0, "> 0"), resumable=True)
    max_bad_steps: int = setting(5, "stop after this many non-finite steps in a row", AT_LEAST_1, resumable=True)
    gradient_accumulation_steps: int = setting(1, "blocks per rank per optimizer step", AT_LEAST_1)
    epochs: int = setting(1, "passes over the data", AT_LEAST_1)
    max_steps: int = setting(0, "> 0: stop after this many steps, no counting pass", AT_LEAST_0, resumable=True)
    warmup_steps: int = setting(10, "linear warmup steps", AT_LEAST_0)
    lr_schedule: str = setting("cosine", "decay after warmup", one_of("cosine", "linear", "constant"))
    min_lr_ratio: float = setting(0.1, "the decay ends at learning_rate * min_lr_ratio", FRACTION)
    loss_chunk_tokens: int = setting(4096, "loss tokens per LM-head chunk", AT_LEAST_1, resumable=True)
    # Output: checkpoints/step_N (sharded, resumable), model/ (the consolidated Hugging Face export), metrics.jsonl
    output_dir: str = setting("outputs/sft", "checkpoints, model/, metrics.jsonl; resumed from", resumable=True)
    save_every: int = setting(100, "steps per checkpoint; 0: at the end; -1: never", AT_LEAST_MINUS_1, resumable=True)
    save_every_minutes: float = setting(0.0, "also save this long after the last; 0: off", AT_LEAST_0, resumable=True)
    async_save: bool = setting(True, "write checkpoints in the background (host memory holds a copy)", resumable=True)
    keep_checkpoints: int = setting(2, "complete checkpoints kept", AT_LEAST_1, resumable=True)
    export: bool = setting(True, "write output_dir/model, the Hugging Face checkpoint, at the end", resumable=True)
    log_every: int = setting(10, "steps per log line (also logged at every checkpoint)", AT_LEAST_1, resumable=True)
    eval_every: int = setting(0, "steps per eval; 0: only at the end (with eval data)", AT_LEAST_0, resumable=True)
    seed: int = setting(0, "data order and initialisation")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = typed(f, getattr(self, f.name), "Config")
            object.__setattr__(self, f.name, value)  # frozen: the only writes are here
            if f.metadata["check"] and not f.metadata["check"][0](value):
                raise UserError(f"bad configuration: {f.name} must be {f.metadata['check'][1]}, got {value!r}")
        if self.eval_split and self.eval_fraction:
            raise UserError("bad configuration: set eval_split or eval_fraction, not both")
        # A local file has no splits: any split name of it reads the whole file.
        eval_file, data_file = Path(self.eval_split).suffix, Path(self.dataset_name).suffix
        split_of_a_file = data_file and not eval_file
        same = (
            self.eval_split == self.dataset_split
            or eval_file
            and Path(self.eval_split).resolve() == Path(self.dataset_name).resolve()
        )
        if self.eval_split and (split_of_a_file or same):
            raise UserError(
                f"bad configuration: eval_split {self.eval_split!r} is the training data: give a held-out "
                "file or split, or set eval_fraction to hold out a share of the records"
            )


def typed(field: dataclasses.Field, value, source: str):
    """value as the field's type (an int for a float field: YAML reads 1 as an int and 1e-5 as a string), or an
    error naming the key and where the value came from."""
    want = type(field.default)
    if want is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # YAML reads a string that looks like a number (activation_checkpointing: 0.75) as one
    if want is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            value = float(value)
        except ValueError:
            pass
    if type(value) is not want:
        raise UserError(f"configuration key {field.name!r} (from {source}) must be {want.__name__}, got {value!r}")
    return value


def load_config(*sources: tuple[str, dict]) -> Config:
    """Config from its defaults and each (source, {key: value}) in turn, later wins. An unknown key or a wrong
    type fails naming the key and its source; Config then checks the values."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    values = {}
    for source, overrides in sources:
        for key, value in overrides.items():
            if key not in fields:
                near = difflib.get_close_matches(key, fields, n=1)
                hint = f"did you mean {near[0]!r}?" if near else f"valid keys: {', '.join(fields)}"
                raise UserError(f"unknown configuration key {key!r} (from {source}); {hint}")
            values[key] = typed(fields[key], value, source)
    return Config(**values)


def yaml_source(path: str | Path, name: str) -> tuple[str, dict]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise UserError(f"{name} {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise UserError(f"{name} {path} is not valid YAML: {' '.join(str(e).split())}") from e
    if not isinstance(data, dict):
        raise UserError(f"{name} {path} must hold a mapping of configuration keys, got {type(data).__name__}")
    return f"{name} {path}", data


def parse_args(argv: list[str], parser: argparse.ArgumentParser | None = None) -> tuple[Config, argparse.Namespace]:
    """Config from defaults <- $HYPERPARAMETERS_PATH <- --config FILE <- --key value. The settings' flags, types
    and help come from Config's fields; a tool passes its own parser for its own flags (tools/inspect_data.py)."""
    usage = "train.py [--config FILE] [--KEY VALUE ...]"
    parser = parser or argparse.ArgumentParser(usage=usage, description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--config", metavar="FILE", help="YAML file of settings (after $HYPERPARAMETERS_PATH's)")
    group = parser.add_argument_group("settings (flags win over files; non-string values are read as YAML: 2e-5, true)")
    for f in dataclasses.fields(Config):
        resume = "; may change on resume" if f.metadata["resumable"] else ""
        need = f"; {f.metadata['check'][1]}" if f.metadata["check"] else ""
        doc = f"{f.metadata['doc']} (default: {f.default!r}{need}{resume})".replace("%", "%%")
        parse = str if isinstance(f.default, str) else yaml.safe_load
        kind = type(f.default).__name__.upper()
        group.add_argument(f"--{f.name}", type=parse, default=argparse.SUPPRESS, metavar=kind, help=doc)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if unknown[0].startswith("--"):  # an unknown key: load_config raises, naming the nearest valid one
            load_config(("command line", {unknown[0][2:].partition("=")[0]: None}))
        raise UserError(f"unexpected argument {unknown[0]!r}; flags are --key value (python train.py --help)")
    params = os.environ.get("HYPERPARAMETERS_PATH")  # a Databricks workload's parameters: block
    sources = [yaml_source(params, "HYPERPARAMETERS_PATH")] if params else []
    sources += [yaml_source(args.config, "--config")] if args.config else []
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if hasattr(args, f.name)}
    return load_config(*sources, ("command line", flags)), args


def fixed_on_resume(saved: dict, cfg: Config) -> dict:
    """The settings a checkpoint was written with that this configuration changes but may not: {key: (old, new)}.
    A field the checkpoint's train.py did not have yet counts as its default."""
    old = {f.name: saved.get(f.name, f.default) for f in dataclasses.fields(cfg)}
    return {
        f.name: (old[f.name], getattr(cfg, f.name))
        for f in dataclasses.fields(cfg)
        if not f.metadata["resumable"] and old[f.name] != getattr(cfg, f.name)
    }


# ------------------------------------------------------------------------------------------------------------
# 2. Distributed setup
# ------------------------------------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # we created the process group, so we destroy it


def setup_distributed() -> Dist:
    """Reads RANK/LOCAL_RANK/WORLD_SIZE (set by torchrun, or by a notebook's @distributed decorator) and joins
    the process group: NCCL on GPUs, gloo on CPU. Without them (a plain `python train.py`, or train() in a
    notebook's own process) it is a world of one on a free local port: two such runs at once do not collide, and
    the port a finished one leaves bound in its process is not the next one's."""
    launched = "WORLD_SIZE" in os.environ
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Expandable segments, as workload.yaml sets them, for every way of launching (docs/BENCHMARKS.md: the stalls
    # without them). Read at CUDA's first allocation; a setting the user made wins.
    if not (os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")):
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    owns_group = not dist.is_initialized()
    if owns_group:
        backend = "nccl" if device.type == "cuda" else "gloo"
        alone = {} if launched else {"init_method": f"tcp://127.0.0.1:{free_port()}", "rank": 0, "world_size": 1}
        device_id = device if backend == "nccl" else None
        dist.init_process_group(backend, timeout=timedelta(minutes=30), device_id=device_id, **alone)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun
        exit_with_launcher()
    return Dist(rank, world_size, device, owns_group)


def exit_with_launcher() -> None:
    """torchrun starts its workers in sessions of their own: if torchrun alone is killed (SIGKILL), they would
    train on, writing the checkpoints a restart reads. A thread watches for the launcher's death and exits."""
    launcher = os.getppid()

    def watch():
        while os.getppid() == launcher:
            time.sleep(1)
        print(f"rank {os.environ.get('RANK')}: the launcher (pid {launcher}) is gone: exiting", flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_every_rank(check, d: Dist):
    """check() on every rank; a UserError on any rank (a file one node lacks, a directory one rank cannot write)
    is raised on every rank, naming the rank, so that rank 0 says it and no rank waits in a collective."""
    try:
        result, error = check(), None
    except UserError as e:
        result, error = None, f"{e} (rank {d.rank})" if d.world_size > 1 else str(e)
    errors = [None] * d.world_size
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise UserError(first)
    return result


def print0(rank: int, *args, file=None) -> None:
    if rank == 0:
        print(*args, file=file, flush=True)


# ------------------------------------------------------------------------------------------------------------
# 3. Data: read this rank's shard, mask assistant turns, pack whole conversations into blocks, count them
# ------------------------------------------------------------------------------------------------------------

ROLES = ("system", "user", "assistant", "tool")


def read_records(source: str, split: str, revision: str, shard: int, num_shards: int, start: int, skips: Counter):
    """Yields (index, record) for the records of one disjoint shard from index `start` on: record i belongs to
    shard i % num_shards.

    Every shard reads the whole stream and keeps its own records (as `split_dataset_by_node` does for a
    stream whose file count the shard count does not divide), so the split is exact for any source.
    Records before `start` (a resumed stream) are passed over without being parsed or tokenized.
    """
    path = Path(source)
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for index, line in enumerate(f):
                if index < start or index % num_shards != shard or not line.strip():  # blank lines are no records
                    continue
                try:
                    yield index, json.loads(line.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    skips["unreadable line"] += 1
                    if skips["unreadable line"] <= 3:  # the first few of each shard, by line number
                        print(f"warning: {source} line {index + 1} is not UTF-8 JSON: skipped", flush=True)
        return
    from datasets import load_dataset  # imported here: a .jsonl file does not need it

    if path.suffix in (".json", ".parquet"):
        stream = load_dataset(path.suffix[1:], data_files=str(path), split="train", streaming=True)
    else:
        stream = load_dataset(source, split=split, streaming=True, revision=revision or None)
    for index, record in enumerate(stream.skip(start), start):
        if index % num_shards == shard:
            yield index, record


def data_source(cfg: Config, part: str) -> tuple[str, str]:
    """(source, split) that a part, "train" or "eval", reads: dataset_name's dataset_split; for eval, eval_split
    (a split of dataset_name, or a local file) or with eval_fraction the training data (its held-out records)."""
    assert part in ("train", "eval"), part
    if part == "train" or cfg.eval_fraction:
        return cfg.dataset_name, cfg.dataset_split
    return (cfg.eval_split, "") if Path(cfg.eval_split).suffix else (cfg.dataset_name, cfg.eval_split)


def held_out(index: int, cfg: Config) -> bool:
    """Whether record `index` of the training data is held out for eval (eval_fraction): a seeded hash of its
    index, so the same records on every rank, in every epoch and after every resume, and never trained."""
    return zlib.crc32(f"{cfg.seed}/{index}".encode()) < cfg.eval_fraction * 2**32


def check_data(cfg: Config, part: str) -> None:
    """Structural problems stop the run here, before any model is loaded: a missing file, a dataset or split that
    cannot be read, an empty dataset, a file that is not JSON lines, records without the conversation column."""
    source, split = data_source(cfg, part)
    if Path(source).suffix and not Path(source).is_file():
        raise UserError(f"data file {source} does not exist")
    counts = Counter()
    try:  # datasets raises ValueError for a split or configuration the dataset lacks, OSError for what it cannot reach
        records = read_records(source, split, cfg.dataset_revision, 0, 1, 0, counts)
        first = [r for _, r in itertools.islice(records, 64)]
    except (ValueError, OSError) as e:
        first_line = str(e).strip().split("\n")[0]
        raise UserError(f"cannot read dataset {source} [{split}]: {first_line}") from e
    if not first:
        problem = "has no readable line: is it JSON lines?" if counts else "is empty"
        raise UserError(f"dataset {source} [{split}] {problem}")
    if not any(isinstance(r, dict) and cfg.messages_column in r for r in first):
        columns = sorted(first[0]) if isinstance(first[0], dict) else type(first[0]).__name__
        raise UserError(
            f"dataset {source} [{split}] has no column {cfg.messages_column!r} in its first records; "
            f"its columns are {columns}: set messages_column to the one holding the conversations"
        )


def conversation_problem(messages) -> str | None:
    """The reason a conversation cannot be trained on, or None. Reasons are counted, not raised."""
    if not isinstance(messages, list) or not messages:
        return "messages not a non-empty list"
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            return "unknown role"
        if not isinstance(m.get("content"), str) or not (m["content"].strip() or m.get("tool_calls")):
            return "empty or non-string content"  # a tool-call turn may have no text
        if not isinstance(m.get("reasoning_content") or "", str):
            return "non-string reasoning_content"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    return None


class AssistantMasker:
    """Tokenizes a conversation with its chat template and marks exactly the assistant turns' tokens.

    Method: render the conversation twice, once as is and once with every message's content (and reasoning)
    replaced by a placeholder. The placeholder rendering is the template's skeleton; it tells where each content
    sits. The real rendering must equal the skeleton with each placeholder replaced by the content (as given, or
    stripped, as many templates trim); if it does not (the template rewrote a content), the conversation is
    skipped and counted, never trained on a guessed mask.
    The loss span of an assistant turn runs from its content's first character (its reasoning's, when the
    template renders one) through the first special token that follows it (the end-of-turn token: <|im_end|>,
    <|eot_id|>, ...), tool-call text in between included: what the model generates after the template's
    generation prompt. A turn that only calls tools (empty content) starts where a content would. The span must
    start and end on token boundaries.

    Reasoning (`reasoning_content`, or `<think>...</think>` at the start of a content, for templates that render
    reasoning_content): trained with its answer, in the text the template renders, which for Qwen3.5 is
    `<think>\n` (the end of its generation prompt) + reasoning + `\n</think>\n\n` + answer. Qwen3.5 renders the
    reasoning of the turns after the last user message only; each earlier turn that has one becomes a sample of
    its own that ends with that turn (see samples()), where its reasoning is rendered as at inference.

    The empty think block: Qwen3/3.5 templates put `<think>\n\n</think>\n\n` before the content of an assistant
    turn without reasoning after the last user message; it is outside the span and not trained. That is
    deliberate: with thinking off the template puts the same text in the prompt, so the model never generates
    it, and training the model to emit an empty think block would teach it to skip reasoning when thinking is
    on. Every turn without reasoning is then trained the same way, wherever it sits.
    """

    def __init__(self, tokenizer):
        if not tokenizer.chat_template:
            raise UserError("the tokenizer has no chat_template; set tokenizer_name to one that has")
        self.tok = tokenizer
        self.special = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len)
        self.renders_reasoning = "reasoning_content" in tokenizer.chat_template

    def samples(self, messages: list[dict], tools: list | None = None) -> list[tuple[list[int], list[bool]]] | str:
        """The conversation's training samples, [(token ids, loss mask), ...], or the reason it is skipped: one
        sample, plus one for each assistant turn whose reasoning the full rendering leaves out."""
        messages = [self.reasoning_apart(m) for m in messages]
        full = self.render(messages, tools)
        if isinstance(full, str) or not full[2]:
            return full if isinstance(full, str) else [full[:2]]
        dropped, samples = full[2], []
        for i in [None, *sorted(dropped)]:  # the whole conversation without those turns, then each with its past
            if i is None:
                one = self.render(messages, tools, skip=dropped)
            else:
                one = self.render(messages[: i + 1], tools, skip=set(range(i)))
            if isinstance(one, str) or i in one[2]:
                return one if isinstance(one, str) else "template drops the reasoning of a last turn"
            samples.append(one[:2])
        return samples

    def __call__(self, messages: list[dict], tools: list | None = None) -> tuple[list[int], list[bool]] | str:
        """One rendering of the whole conversation: (token ids, loss mask), or the reason it is skipped."""
        result = self.render([self.reasoning_apart(m) for m in messages], tools)
        return result if isinstance(result, str) else result[:2]

    def reasoning_apart(self, m: dict) -> dict:
        """`<think>...</think>` at the start of an assistant content as reasoning_content, for templates that
        render reasoning_content (Qwen3.5 splits it off itself, which would change the content it renders)."""
        content = m["content"]
        if not self.renders_reasoning or m["role"] != "assistant" or "</think>" not in content:
            return m
        reasoning, _, answer = content.partition("</think>")
        return {**m, "reasoning_content": reasoning.split("<think>")[-1].strip("\n"), "content": answer.lstrip("\n")}

    def render(self, messages: list[dict], tools, skip=()) -> tuple[list[int], list[bool], set] | str:
        """(token ids, loss mask over the assistant turns not in skip, the turns whose reasoning the template did
        not render), or the reason the conversation is skipped."""
        texts = [
            m["content"] + (m.get("reasoning_content") or "") + json.dumps(m.get("tool_calls"), default=str)
            for m in messages
        ]
        if any(s in t for t in texts + [json.dumps(tools, default=str)] for s in self.special):
            return "special-token text in a content"  # it would be tokenized as real turn markers
        if not self.renders_reasoning and any(m.get("reasoning_content") for m in messages):
            return "reasoning the template does not render (set reasoning: drop)"
        # An empty content (an assistant turn that only calls tools) keeps no placeholder: templates render the
        # calls differently after a content (Qwen3.5: a blank line first).
        slots = []  # (message index, placeholder, its text) in the order a template renders them
        skeleton_messages = []  # the messages with the placeholders in place of their texts
        for i, m in enumerate(messages):
            skeleton_messages.append(dict(m))
            if self.renders_reasoning and m["role"] == "assistant" and (m.get("reasoning_content") or "").strip():
                slots.append((i, f"\ue000r{i}\ue001", m["reasoning_content"]))
                skeleton_messages[i]["reasoning_content"] = slots[-1][1]
            if m["content"]:
                slots.append((i, f"\ue000c{i}\ue001", m["content"]))
                skeleton_messages[i]["content"] = slots[-1][1]
        render = partial(self.tok.apply_chat_template, tools=tools, tokenize=False)
        try:  # templates raise on conversations they refuse (e.g. Qwen3.5: no user turn)
            text, skeleton = render(messages), render(skeleton_messages)
            empty = [i for i, m in enumerate(messages) if not m["content"] and i not in skip]
            call_only = {i: self.call_only_turn(render, messages, i, text) for i in empty}
        except Exception as e:  # jinja2's TemplateError, or whatever the template's own raise_exception gives
            return f"chat template error: {str(e)[:80]}"
        dropped = {i for i, holder, _ in slots if holder[1] == "r" and holder not in skeleton}
        if None in call_only.values():
            return "template renders content-dependently"
        spans, pos, rest, reasoning_at = [], 0, skeleton, {}
        for i, holder, value in [slot for slot in slots if slot[0] not in dropped or slot[1][1] == "c"]:
            before, found, rest = rest.partition(holder)
            if not found or not text.startswith(before, pos):
                return "template renders content-dependently"
            pos += len(before)
            after = rest.split("\ue000", 1)[0]  # skeleton text up to the next placeholder
            value = next((v for v in (value, value.strip()) if text.startswith(v + after, pos)), None)
            if value is None:
                return "template renders content-dependently"
            if holder[1] == "r":
                reasoning_at[i] = pos  # the span of a turn with rendered reasoning starts with it
            elif messages[i]["role"] == "assistant" and i not in skip:
                end = self.end_of_turn(after)
                if end is None:
                    return "no end-of-turn token after an assistant turn"
                spans.append((reasoning_at.get(i, pos), pos + len(value) + end))
            pos += len(value)
        if text[pos:] != rest:
            return "template renders content-dependently"
        spans += [(reasoning_at.get(i, start), end) for i, (start, end) in call_only.items()]
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)  # spans: character ranges
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        mask = [any(a <= start and end <= b for a, b in spans) for start, end in offsets]
        starts = {start for start, _ in offsets}
        ends = {end for _, end in offsets}
        if any(a not in starts or b not in ends for a, b in spans):
            return "assistant span not on token boundaries"
        return ids, mask, dropped

    def end_of_turn(self, text: str, start: int = 0) -> int | None:
        """Where the first special token at or after start ends (the longest one that starts there), or None."""
        first = min((k for k in (text.find(s, start) for s in self.special) if k >= 0), default=-1)
        return None if first < 0 else first + max(len(s) for s in self.special if text.startswith(s, first))

    def call_only_turn(self, render, messages: list[dict], i: int, text: str) -> tuple[int, int] | None:
        """The loss span of assistant turn i, whose content is empty (it only calls tools): from where a content
        would start (found by rendering one in its place; the text before it must not change) or, for a template
        that renders no content beside calls (Llama 3.1), from the end of its generation prompt, through the first
        special token after it, the end of the turn, which must hold the calls' names. None if the template
        renders the turn otherwise (puts the calls before a content, say)."""
        variant = render([{**m, "content": "\ue000"} if j == i else m for j, m in enumerate(messages)])
        start, m = variant.find("\ue000"), messages[i]
        prefix = variant[:start] if start >= 0 else render(messages[:i], add_generation_prompt=True)
        start = len(prefix)
        end = self.end_of_turn(text, start) if text.startswith(prefix) else None
        names = [(c.get("function") or c).get("name", "") for c in m.get("tool_calls") or [] if isinstance(c, dict)]
        if m["role"] != "assistant" or end is None or not all(str(n) in text[start:end] for n in names):
            return None
        return start, end


def conversation_of(record, cfg: Config) -> tuple[list, list | None] | str:
    """A record's (messages, tools) in the form chat templates take, or the reason to skip it: content given as
    parts ([{"type": "text", "text": ...}]) has its texts joined, as the Qwen3.5 and Llama 3.1 templates join
    them (an image or audio part skips the record); tool definitions and tool-call arguments given as JSON text
    (OpenAI's form) are parsed."""
    if not isinstance(record, dict) or cfg.messages_column not in record:
        return f"missing column {cfg.messages_column!r}"
    messages, tools = record[cfg.messages_column], record.get(cfg.tools_column)
    try:
        tools = json.loads(tools) if isinstance(tools, str) else tools
        if not isinstance(messages, list):
            return messages, tools  # conversation_problem names it
        joined = []
        for m in messages:
            parts = m.get("content") if isinstance(m, dict) else None
            if isinstance(parts, list):
                if not all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts
                ):
                    return "a content part that is not text"
                m = {**m, "content": "".join(p["text"] for p in parts)}
            if isinstance(m, dict) and isinstance(m.get("tool_calls"), list):
                m = {**m, "tool_calls": [parsed_arguments(call) for call in m["tool_calls"]]}
                m["content"] = "" if m.get("content") is None else m["content"]  # OpenAI's form: null
            if cfg.reasoning == "drop" and isinstance(m, dict) and m.get("role") == "assistant":
                m = {k: v for k, v in m.items() if k != "reasoning_content"}
                if isinstance(m.get("content"), str) and "</think>" in m["content"]:
                    m["content"] = m["content"].partition("</think>")[2].lstrip("\n")
            joined.append(m)
    except json.JSONDecodeError:
        return "tools or tool-call arguments not JSON"
    return joined, tools


def parsed_arguments(call):
    """A tool call's arguments as a mapping: parsed from JSON text; None values dropped (a hub or Parquet
    dataset gives every call the keys of all of them, None where a call has none)."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    if isinstance(arguments, dict):
        arguments = {k: v for k, v in arguments.items() if v is not None}
    function = {**function, "arguments": arguments}
    return {**call, "function": function} if "function" in call else function


EXTRA_SAMPLES = "extra samples for earlier reasoning turns"  # a count beside conversations, not a skip reason


def tokenize_stream(records, masker: AssistantMasker, cfg: Config, counts: Counter):
    """Yields (index, samples) per trainable conversation, samples a list of (ids, mask) (more than one when
    earlier turns' reasoning needs samples of their own); counts every skip by reason and every truncation."""
    for index, record in records:
        result = conversation_of(record, cfg)
        if not isinstance(result, str):
            messages, tools = result
            result = conversation_problem(messages) or masker.samples(messages, tools)
        if isinstance(result, str):
            counts[result] += 1
            continue
        samples = [(ids[: cfg.max_seq_len], mask[: cfg.max_seq_len]) for ids, mask in result]
        if any(len(ids) > cfg.max_seq_len for ids, _ in result):
            counts["truncated"] += 1
        # A sample may have no trained turn left: truncated, or all its turns were trained in samples of their own.
        samples = [(ids, mask) for ids, mask in samples if any(mask[1:])]
        if not samples:
            counts["no loss tokens after truncation"] += 1
            continue
        counts["conversations"] += 1
        if len(samples) > 1:
            counts[EXTRA_SAMPLES] += len(samples) - 1
        yield index, samples


def skip_reasons(counts: dict) -> dict:
    """The skipped records by reason, from a stream's counts (which also hold conversations and truncations)."""
    return {k: v for k, v in counts.items() if k not in ("conversations", "truncated", EXTRA_SAMPLES)}


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each bin's lengths summing to <= capacity. Longest first, each into the fullest
    bin it still fits (best fit); within 11/9 of the optimal bin count. Every length must be <= capacity."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: room[b])
            bins[b].append(i)
            room[b] -= lengths[i]
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def make_block(segments: list[tuple[list[int], list[bool]]], block_len: int, pad_id: int) -> dict:
    """One packed block from whole conversations, with the signals that keep them apart.

    Worked example, segments of 3 and 2 tokens, block_len 7 (2 tokens of padding, a segment of its own):
      position_ids [0 1 2 0 1 0 1]   cu_seqlens [0 3 5 7]   seq_idx [0 0 0 1 1 2 2]   max_length 3
      labels: the token where the mask is set, else -100; always -100 on each segment's first token (its
      causal target would come from the previous segment) and on padding.
    """
    pad = block_len - sum(len(seg_ids) for seg_ids, _ in segments)
    assert pad >= 0, "segments longer than the block"
    padding = [([pad_id] * pad, [False] * pad)] if pad else []
    ids, labels, positions, seq_idx, bounds = [], [], [], [], [0]
    for n, (seg_ids, seg_mask) in enumerate(segments + padding):
        ids += seg_ids
        labels += [-100] + [t if m else -100 for t, m in zip(seg_ids[1:], seg_mask[1:])]
        positions += range(len(seg_ids))
        seq_idx += [n] * len(seg_ids)
        bounds.append(len(ids))
    return {
        "input_ids": torch.tensor([ids]),
        "labels": torch.tensor([labels]),
        "position_ids": torch.tensor([positions]),
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
        "max_length": max(b - a for a, b in zip(bounds, bounds[1:])),
        "seq_idx": torch.tensor([seq_idx], dtype=torch.int32),
        "tokens": block_len - pad,  # tokens that are not padding
        "loss_tokens": sum(label != -100 for label in labels),
        "sum_sq_len": sum(len(seg_ids) ** 2 for seg_ids, _ in segments),  # for the attention FLOPs
    }


@dataclass
class StreamPosition:
    """Where a block sits in its data stream: its buffer's start, and the stream's counts (conversations, skips
    by reason, truncations) when the buffer started and once it was read; built once per buffer, each block gets
    a copy with its number. A resumed stream restarts at `record`, re-packs the buffer, passes over the blocks
    already taken and restores its counts from counts_at_start."""

    slot: int  # the DataLoader worker slot that reads this stream
    epoch: int
    record: int  # index of the buffer's first record in the stream
    buffer: int  # buffers before this one in the epoch: it seeds the order of the buffer's blocks
    counts_at_start: dict
    counts_at_end: dict
    taken: int = 0  # blocks taken from the buffer, this one included


class PackedBlocks(IterableDataset):
    """This rank's packed blocks, `epochs` passes over its shard, for a DataLoader with batch_size=None.

    Shards are disjoint per (rank, DataLoader worker): worker slot s of rank r reads shard r * workers + s.
    Each worker fills a buffer with pack_buffer_blocks blocks' worth of conversations, packs it by best-fit
    decreasing, and yields its blocks in a seeded random order (the packer emits the longest conversations
    first). Nothing carries over between buffers, so a block's place in its stream is its buffer's
    StreamPosition and its number in the buffer.

    resume: a Progress, whose streams hold the position of each stream's last consumed block and next_slot
    the slot of the next block. The DataLoader takes blocks from its workers in turn,
    starting with worker 0, so worker w reads slot (w + next_slot) % workers: the turn order goes on.
    """

    def __init__(self, cfg: Config, tokenizer, part: str, rank: int, world_size: int, epochs: int, resume=None):
        self.cfg, self.tok, self.part = cfg, tokenizer, part
        self.rank, self.world_size, self.epochs = rank, world_size, epochs
        self.streams, self.next_slot = (dict(resume.streams), resume.next_slot) if resume else ({}, 0)

    def __iter__(self):
        cfg, worker = self.cfg, get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker else (0, 1)
        slot = (worker_id + self.next_slot) % num_workers
        shard, num_shards = self.rank * num_workers + slot, self.world_size * num_workers
        source, split = data_source(cfg, self.part)
        masker = AssistantMasker(self.tok)
        pad_id = pad_token_id(self.tok)
        at = self.streams.get(slot, StreamPosition(slot, 0, 0, 0, {}, {}))
        counts = Counter(at.counts_at_start)
        for epoch in range(at.epoch, self.epochs):
            first, n_buffer, skip = (at.record, at.buffer, at.taken) if epoch == at.epoch else (0, 0, 0)
            # The counts are of the data, not of the passes over it: a later epoch re-reads the same records.
            tally = counts if epoch == 0 else Counter()
            records = read_records(source, split, cfg.dataset_revision, shard, num_shards, first, tally)
            if cfg.eval_fraction:  # the held-out records are eval's, the others training's
                records = ((i, r) for i, r in records if held_out(i, cfg) == (self.part == "eval"))
            buffer, buffered, start_counts = [], 0, dict(counts)
            for index, samples in tokenize_stream(records, masker, cfg, tally):  # a record's samples share a buffer
                buffer += samples
                buffered += sum(len(ids) for ids, _ in samples)
                if buffered >= cfg.pack_buffer_blocks * cfg.max_seq_len:
                    where = StreamPosition(slot, epoch, first, n_buffer, start_counts, dict(counts))
                    yield from self._pack(buffer, pad_id, shard, where, skip)
                    buffer, buffered, first, n_buffer, skip = [], 0, index + 1, n_buffer + 1, 0
                    start_counts = dict(counts)
            where = StreamPosition(slot, epoch, first, n_buffer, start_counts, dict(counts))
            yield from self._pack(buffer, pad_id, shard, where, skip)
        # The stream's end: an item without a block that carries its final counts (a rank whose records all were
        # skipped makes no block, yet its counts must reach the totals). Resumed from, it starts past the last epoch.
        yield {"position": StreamPosition(slot, self.epochs, 0, 0, dict(counts), dict(counts))}

    def _pack(self, buffer, pad_id: int, shard: int, where: StreamPosition, skip: int):
        bins = best_fit_decreasing([len(ids) for ids, _ in buffer], self.cfg.max_seq_len)
        random.Random(str((self.cfg.seed, shard, where.epoch, where.buffer))).shuffle(bins)
        for n, members in enumerate(bins[skip:], skip + 1):
            block = make_block([buffer[i] for i in members], self.cfg.max_seq_len, pad_id)
            yield {**block, "position": dataclasses.replace(where, taken=n)}


def block_loader(cfg: Config, tokenizer, part: str, rank: int, world_size: int, epochs: int, resume=None):
    blocks = PackedBlocks(cfg, tokenizer, part, rank, world_size, epochs, resume)
    # Workers pack while the GPU trains. Each worker is its own shard: the DataLoader takes blocks from the
    # workers in turn and goes on with the others when one runs out.
    extra = {"prefetch_factor": 4, "persistent_workers": False, "worker_init_fn": leave_process_group}
    extra = extra if cfg.num_workers else {}
    return DataLoader(
        blocks, batch_size=None, num_workers=cfg.num_workers, pin_memory=torch.cuda.is_available(), **extra
    )


COUNTING_PROGRESS_S = 60  # seconds between the counting pass's progress lines


def leave_process_group(worker_id: int) -> None:
    """A DataLoader worker leaves its training process's process group: torchrun sends SIGTERM to the group, and it
    is for the training process to handle (it finishes the step and saves; its workers then go down with it)."""
    os.setpgrp()


def count_blocks(cfg: Config, tokenizer, d: Dist) -> tuple[int, dict]:
    """The counting pass, for a stream of unknown length: pack this rank's shard once (no model needed), so
    the total step count is exact and bad data shows up before any weights are loaded. Returns the largest
    per-rank block count and the packing statistics summed over ranks."""
    seen, tokens, loss_tokens, shown = Progress(), 0, 0, time.monotonic()
    loader = block_loader(cfg, tokenizer, "train", d.rank, d.world_size, epochs=1)
    for block in seen.blocks_of(loader, cfg.num_workers):  # each stream's counts kept, a blockless one's too
        tokens, loss_tokens = tokens + block["tokens"], loss_tokens + block["loss_tokens"]
        if time.monotonic() - shown > COUNTING_PROGRESS_S:  # a large dataset takes minutes: show that it moves
            shown = time.monotonic()
            print0(
                d.rank, f"counting: {seen.blocks:,} blocks so far on rank 0, {block['position'].record:,} records in"
            )
    totals = [None] * d.world_size
    dist.all_gather_object(totals, (seen.blocks, tokens, loss_tokens, seen.stream_counts()))
    blocks_per_rank = [t[0] for t in totals]
    counts = sum((Counter(t[3]) for t in totals), Counter())
    capacity = max(1, sum(blocks_per_rank) * cfg.max_seq_len)
    skipped = skip_reasons(counts)
    stats = {
        "blocks": sum(blocks_per_rank),
        "blocks_per_rank_min_max": [min(blocks_per_rank), max(blocks_per_rank)],
        "conversations": counts["conversations"],
        "non_padding_fraction": round(sum(t[1] for t in totals) / capacity, 4),
        "loss_token_fraction": round(sum(t[2] for t in totals) / capacity, 4),
        "extra_samples_for_reasoning": counts[EXTRA_SAMPLES],
        "truncated": counts["truncated"],
        "skipped": sum(skipped.values()),
        "skipped_by_reason": skipped,
    }
    return max(blocks_per_rank), stats


def step_count(cfg: Config, tokenizer, d: Dist, meta: dict | None) -> tuple[int, dict | None]:
    """max_steps if set (also when resuming: a larger one extends the run); else the count a resumed run started
    with; else the counting pass's, with its packing statistics."""
    if cfg.max_steps or meta:
        return cfg.max_steps or meta["total_steps"], None
    t0 = time.perf_counter()
    max_blocks, stats = count_blocks(cfg, tokenizer, d)
    print0(d.rank, f"data: {json.dumps(stats)} (counted in {time.perf_counter() - t0:.0f}s)")
    if max_blocks == 0:
        raise UserError(f"no trainable conversation in {cfg.dataset_name} [{cfg.dataset_split}]: {stats}")
    check_skips(stats["skipped"], stats["skipped"] + stats["conversations"], stats["skipped_by_reason"], cfg)
    return math.ceil(cfg.epochs * max_blocks / cfg.gradient_accumulation_steps), stats


def check_skips(skipped: int, records: int, reasons: dict, cfg: Config) -> None:
    if records and skipped / records > cfg.max_skip_fraction:
        raise UserError(
            f"{skipped} of {records} records cannot be trained on (more than max_skip_fraction "
            f"{cfg.max_skip_fraction}): {reasons}. Fix the data, or raise max_skip_fraction"
        )


def pad_token_id(tokenizer) -> int:
    """Padding never carries loss, so any id will do; Llama's tokenizer has no pad token: use end-of-sequence."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def from_hub(load, name: str):
    """Runs a hub load; a gated or private repo without a token becomes an error that says what to do."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        return load()
    except (OSError, GatedRepoError, RepositoryNotFoundError) as e:
        cause = e if isinstance(e, (GatedRepoError, RepositoryNotFoundError)) else e.__cause__
        if isinstance(cause, (GatedRepoError, RepositoryNotFoundError)) and not os.environ.get("HF_TOKEN"):
            raise UserError(
                f"{name} is gated or private and HF_TOKEN is not set: accept its license on the hub, "
                "then set HF_TOKEN (in a workload: secrets: {HF_TOKEN: scope/key})"
            ) from e
        first_line = str(e).strip().split("\n")[0]
        raise UserError(f"cannot load {name}: {first_line} (a local directory, or the hub name and network?)") from e


def load_tokenizer(cfg: Config):
    from transformers import AutoTokenizer

    name = cfg.tokenizer_name or cfg.model_name
    revision = (cfg.model_revision or None) if not cfg.tokenizer_name and not Path(name).exists() else None
    remote_code = cfg.trust_remote_code
    return from_hub(lambda: AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=remote_code), name)


# ------------------------------------------------------------------------------------------------------------
# 4. Model: check kernels, build, activation checkpointing, FSDP2, load
# ------------------------------------------------------------------------------------------------------------


def torch_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function over PyTorch's own varlen flash kernel (no flash-attn build needed).

    query [1, Hq, T, D], key/value [1, Hkv, T, D] -> output [1, T, Hq, D]. Segments come from cu_seq_lens_q;
    the attention mask is unused (transformers builds none for a name without a registered mask function).
    """
    from torch.nn.attention.varlen import varlen_attn

    unsupported = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
    if dropout or unsupported:
        raise NotImplementedError(f"torch_varlen does not do {unsupported or 'dropout'}: use flash_attention_2")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if k.shape[1] != q.shape[1]:  # GQA: torch 2.11's varlen_attn has no enable_gqa
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=(-1, 0))  # (-1, 0): causal
    return out.unsqueeze(0), None


def resolve_attention(requested: str, device: torch.device) -> str:
    """auto: flash-attn if installed; else on CUDA PyTorch's varlen flash kernel; else sdpa, for which
    transformers derives the block-diagonal mask from the reset position_ids (only without a cache)."""
    has_flash_attn = importlib.util.find_spec("flash_attn") is not None
    if requested == "auto":
        requested = "flash_attention_2" if has_flash_attn else "torch_varlen" if device.type == "cuda" else "sdpa"
    if requested == "flash_attention_2" and not has_flash_attn:
        raise UserError(
            "attn_implementation=flash_attention_2 needs flash-attn: pip install flash-attn "
            "--no-build-isolation, or use torch_varlen (CUDA) / sdpa"
        )
    if requested == "torch_varlen":
        if device.type != "cuda" or importlib.util.find_spec("torch.nn.attention.varlen") is None:
            raise UserError("attn_implementation=torch_varlen needs CUDA and torch >= 2.10; use sdpa on CPU")
        from transformers import AttentionInterface

        AttentionInterface.register("torch_varlen", torch_varlen_attention)
    return requested


def require_kernels(config) -> None:
    """Hybrid models (any linear_attention layer) need the fused kernels: without them transformers either
    refuses the packed signals deep inside the first forward or, given position_ids alone, silently lets the
    recurrent and convolution state flow from one packed conversation into the next."""
    if "linear_attention" not in (getattr(config.get_text_config(), "layer_types", None) or []):
        return
    needed = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}
    missing = [pkg for module, pkg in needed.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise UserError(
            f"{config.model_type} has linear-attention layers and needs {' and '.join(missing)}: "
            "pip install flash-linear-attention, and build causal-conv1d against your torch "
            "(bash scripts/setup_node.sh does both)"
        )
    if fla_refuses_hopper_backward():
        raise UserError(
            "flash-linear-attention refuses the Gated DeltaNet backward on this Hopper GPU with this Triton (>= 3.4, "
            "< 3.7.1 computes its gradients wrongly there, fla issue #640) and has no TileLang backend instead: "
            "pip install tilelang==0.1.15 (scripts/setup_node.sh does) and put nvcc on PATH, or use torch >= 2.12.1"
        )


def fla_refuses_hopper_backward() -> bool:
    """fla's own guard condition (it raises at the first backward, after the counting pass and the weight load):
    a Hopper GPU, Triton >= 3.4 and < 3.7.1, and no usable TileLang backend (tilelang installed, an nvcc found,
    FLA_TILELANG not 0), to which fla then sends the affected kernel."""
    import fla.ops.common.chunk_o as guard
    from fla.ops.common.backends.tilelang import CommonTileLangBackend

    guarded = guard.IS_NVIDIA_HOPPER and guard.TRITON_ABOVE_3_4_0 and not guard.TRITON_ABOVE_3_7_1
    return guarded and not CommonTileLangBackend.can_use()


def check_model_settings(config, cfg: Config, device: torch.device) -> None:
    """The settings build_model applies that this model and device must support: the block length within the
    model's positions; float8's GPU and package."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit and cfg.max_seq_len > limit:
        raise UserError(f"max_seq_len {cfg.max_seq_len} exceeds the model's max_position_embeddings {limit}")
    if cfg.float8 and (device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)):
        raise UserError("float8 needs an NVIDIA GPU with float8 matmuls (Hopper or newer); set float8: false")
    if cfg.float8 and importlib.util.find_spec("torchao") is None:
        raise UserError("float8 needs torchao: pip install torchao==0.18.0")


def pretrained_dir(cfg: Config) -> Path:
    """The checkpoint's directory: model_name itself if local, else a hub snapshot of its safetensors, configs
    and tokenizer files in HF_HOME. Every rank asks for it: huggingface_hub's file locks let one process of a
    node download each file while the others wait on the lock (not in a collective, which would time out
    while 55 GB download). Weights are read from safetensors only: pickled .bin files can run code."""
    path = Path(cfg.model_name)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.jinja", "*.txt", "*.model"] + (["*.safetensors"] if cfg.init == "pretrained" else [])
        revision = cfg.model_revision or None
        download = partial(snapshot_download, cfg.model_name, revision=revision, allow_patterns=patterns)
        path = Path(from_hub(download, cfg.model_name))
    if cfg.init == "pretrained" and not any(path.glob("*.safetensors")):
        raise UserError(
            f"{cfg.model_name} has no .safetensors weights, and this recipe reads no other format "
            "(pickled .bin files can run code): convert it with save_pretrained(safe_serialization=True)"
        )
    return path


def model_config(name: str | Path, revision: str = "", trust_remote_code: bool = False):
    """The model's config (hub or local) with the cache off."""
    from transformers import AutoConfig

    revision = revision if not Path(name).exists() else ""
    load = partial(AutoConfig.from_pretrained, name, revision=revision or None, trust_remote_code=trust_remote_code)
    config = from_hub(load, str(name))
    # use_cache=False on the config and the text config: with a cache, transformers does not derive the
    # block-diagonal mask from position_ids and packed conversations attend to each other.
    config.use_cache = False
    config.get_text_config().use_cache = False
    return config


def build_model(config, cfg: Config, attn: str, device: torch.device):
    """The model, sharded, with uninitialised parameters: built on the meta device (no memory), activation
    checkpointing, fully_shard each decoder layer then the root (which keeps the embeddings, final norm,
    LM head and any vision tower), then each rank allocates only its own shards. Parameters are kept in
    master_dtype, all-gathered in param_dtype, gradients reduce-scattered in reduce_dtype. VLM-layout checkpoints
    such as qwen3_5 use their image-text class, so every tensor the checkpoint has is loaded and exported."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    image_text = type(config) in AutoModelForImageTextToText._model_mapping
    model_class = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    with torch.device("meta"):
        model = model_class.from_config(
            config,
            attn_implementation=attn,
            dtype=getattr(torch, cfg.master_dtype),
            trust_remote_code=cfg.trust_remote_code,
        )
    # Text-only SFT trains the decoder and the LM head. Anything else (a VLM's vision tower) would get no gradient,
    # so AdamW would hold no state for it and a resume could not match the checkpoint: freeze it. It is still
    # saved and exported.
    trained = {id(p) for p in model.get_decoder().parameters()} | {id(model.get_output_embeddings().weight)}
    for p in model.parameters():
        p.requires_grad_(id(p) in trained)
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        raise UserError("the model's LM head has a bias: HeadLoss (the fused head and loss) computes without one")
    layers = model.get_decoder().layers
    share = recompute_share(cfg.activation_checkpointing)
    if share is None or share > 0:
        # transformers wraps each decoder layer's forward, inside FSDP's hooks, so a recomputed layer does not
        # all-gather its parameters a second time outside FSDP's bookkeeping. A fraction f < 1 recomputes an
        # evenly spread f of the layers; the others keep their activations (docs/BENCHMARKS.md: GiB per layer).
        # auto starts with every layer recomputed; RecomputeProbe keeps layers' activations after the second step.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        n = len(layers)
        k = round((1.0 if share is None else share) * n)  # layers recomputed; integer arithmetic spreads them
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = (i + 1) * k // n > i * k // n
    if cfg.float8:
        # Only the MLPs: they hold ~70% of a layer's matmul FLOPs and are compiled, so float8's scaling and casts
        # fuse into neighbouring kernels; eager, each cast would be a pass over memory of its own.
        # The weights stay parameters of their dtype and names: checkpoints and the export do not change.
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = Float8LinearConfig.from_recipe_name("rowwise")
        for layer in layers:
            for module in layer.modules():
                if type(module).__name__.endswith("MLP"):
                    convert_to_float8_training(module, config=recipe)
    if cfg.compile:
        compile_elementwise(layers)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, cfg.param_dtype), reduce_dtype=getattr(torch, cfg.reduce_dtype)
    )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    # Buffers are not in the checkpoint (rotary inv_freq): compute them, as transformers' own meta-device
    # loading does, with the model's initialiser applied to the modules that hold them.
    for module in model.modules():
        if module._buffers:
            model._init_weights(module)
    # token_losses calls the decoder and the LM head directly, not model.forward; registering it makes FSDP
    # all-gather the root's parameters around it as it does around forward.
    model.token_losses = token_losses.__get__(model)
    register_fsdp_forward_method(model, "token_losses")
    return model


def compile_elementwise(layers) -> None:
    """torch.compile the decoder layers' RMSNorms and MLPs. In eager mode each is a chain of memory-bound
    elementwise kernels (the norms upcast to fp32 and write every intermediate; SiLU and the gate product are
    separate passes over the MLP's 17,408-wide rows in the 27B); compiled, each chain is one or two fused
    kernels, and fewer intermediates are saved for backward (docs/BENCHMARKS.md measures both).
    The token mixers stay eager: fla's Triton kernels and causal-conv1d are opaque to the compiler. Shapes are
    static: one graph per input shape and grad mode (a norm sees up to three shapes: hidden states, query and
    key heads; x training and eval; x full and filler blocks), hence the raised recompile limit (8 by default;
    past it dynamo runs new shapes eagerly, with a warning)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    for layer in layers:
        for module in layer.modules():
            if type(module).__name__.endswith(("RMSNorm", "RMSNormGated", "MLP")):
                module.compile(dynamic=False)


def checkpoint_dtypes(path: Path) -> dict:
    """{tensor name: dtype} of a Hugging Face safetensors checkpoint, from its headers."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    metadata = HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata
    return {name: meta.properties.dtype for name, meta in metadata.items()}


def load_pretrained(model, path: Path, source_dtypes: dict) -> None:
    """Each rank reads only its own slices of the safetensors files (DCP's HuggingFaceStorageReader), cast to
    the master dtype: no rank ever holds the whole model. Tensors the model has no module for (mtp.* heads)
    stay in the files; every parameter must be found, except an LM head tied to the embeddings."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = model.state_dict()
    tied_head = "lm_head.weight" if model.config.tie_word_embeddings else None
    missing = [k for k in state if k not in source_dtypes and k != tied_head]
    if missing:
        raise UserError(f"{len(missing)} model tensors are not in the checkpoint at {path}, e.g. {missing[:3]}")
    dcp.load({k: v for k, v in state.items() if k in source_dtypes}, storage_reader=HuggingFaceStorageReader(str(path)))


def init_random(model, seed: int) -> None:
    """init: random. The model's own initialiser on this rank's shards, for benchmarks and tests: no weights to
    read, and the step times are those of a real run. (On CPU, DTensor draws every rank's shard from the same
    generator state, so the shards repeat: fine for timing and tests, not for training.)"""
    from torch.distributed.tensor.experimental import implicit_replication

    torch.manual_seed(seed)
    # implicit_replication: initialisers that copy a plain tensor into a sharded parameter (qwen3_5's A_log) copy
    # this rank's slice of it.
    with torch.no_grad(), implicit_replication():
        for module in model.modules():
            model._init_weights(module)


def packed_inputs(block: dict) -> dict:
    """The model's inputs for a packed block: the token ids and the signals that keep its conversations apart."""
    return {
        "input_ids": block["input_ids"],
        "position_ids": block["position_ids"],  # full attention: rotary positions, and sdpa's block mask
        "cu_seq_lens_q": block["cu_seqlens"],  # varlen attention and the gated-delta rule
        "cu_seq_lens_k": block["cu_seqlens"],
        "max_length_q": block["max_length"],
        "max_length_k": block["max_length"],
        "seq_idx": block["seq_idx"],  # causal-conv1d
        "use_cache": False,  # a cache would also stop sdpa's block mask from being derived
    }


def token_losses(model, block: dict, chunk_tokens: int = 4096) -> torch.Tensor:
    """Per-token cross-entropy (fp32) at the block's loss positions, in the order they appear.

    The LM head runs only on positions whose next token is a loss target, chunk_tokens at a time: the
    full-vocabulary logits of a 32k block (248,320 columns, 16 GB in bf16) are never formed. With gradients on,
    HeadLoss computes each chunk's gradients in the forward. The hidden state at t predicts labels[t + 1]
    (labels follow the Hugging Face convention).
    """
    hidden = model.model(**packed_inputs(block)).last_hidden_state[0]
    targets = block["labels"][0, 1:]
    where = (targets != -100).nonzero().squeeze(1)
    # A block without loss tokens still goes through HeadLoss, so the graph (and FSDP's backward hooks) stays
    # connected: its loss is an exact 0, never a NaN.
    head = model.get_output_embeddings()
    return HeadLoss.apply(hidden[where], head.weight, targets[where], chunk_tokens, torch.is_grad_enabled())


class HeadLoss(torch.autograd.Function):
    """The LM head and cross-entropy over the loss positions, with their gradients computed in the forward.

    Per chunk the forward forms the log-probabilities (fp32), each token's loss, and d loss / d logits =
    softmax - one-hot, and multiplies that at once into the gradients of the hidden states and of the head's
    weight; backward only scales them. A chunk's logits are formed once and never kept: checkpointing each chunk
    instead formed them a second time in backward (the head's matmul again; docs/BENCHMARKS.md, fourth round,
    has what that cost). The weight's gradient is summed over all tokens before backward knows their upstream
    gradients, so it holds only when every token's loss has the same weight: sum(losses) * a constant, the
    recipe's one use. backward checks that (without a host sync)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens: int, with_grads: bool):
        # with_grads: the caller's grad mode (forward itself runs without), off for evaluation
        losses = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if with_grads else None
        grad_weight = torch.zeros_like(weight) if with_grads else None
        for start in range(0, len(targets), chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            h, y = hidden[rows], targets[rows]
            log_probs = (h @ weight.T).log_softmax(dim=1, dtype=torch.float32)  # the chunk's largest tensor
            losses[rows] = -log_probs.gather(1, y[:, None]).squeeze(1)
            if with_grads:
                softmax = log_probs.exp_()  # in place: the same tensor
                softmax[torch.arange(len(y), device=y.device), y] -= 1
                grad_logits = softmax.to(hidden.dtype)
                grad_hidden[rows] = grad_logits @ weight
                grad_weight.addmm_(grad_logits.T, h)
                del softmax, grad_logits
            # Freed before the next chunk allocates its own: the peak holds one chunk's tensors, not two (at 4,096
            # tokens and a 248k vocabulary, 4 GB in fp32 and 2 GB in bf16).
            del log_probs
        ctx.save_for_backward(grad_hidden, grad_weight)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        grad_hidden, grad_weight = ctx.saved_tensors
        torch._assert_async((grad_losses == grad_losses[:1]).all(), "HeadLoss: every token's loss must weigh the same")
        scale = grad_losses[:1].sum()  # 0 when there are no loss tokens
        # In place: no second copy of the head's gradient (2.5 GB for the 27B). A second backward through the same
        # graph (retain_graph) would fail autograd's check that saved tensors are unchanged, not double-scale.
        return grad_hidden.mul_(grad_losses[:, None].to(grad_hidden.dtype)), grad_weight.mul_(scale), None, None, None


# ------------------------------------------------------------------------------------------------------------
# 5. Training: one step, the log line, the loop
# ------------------------------------------------------------------------------------------------------------


def lr_factor(step: int, cfg: Config, total_steps: int) -> float:
    """Linear warmup to learning_rate over warmup_steps, then cosine or linear decay to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def make_optimizer(model, cfg: Config, d: Dist, total_steps: int):
    """AdamW with warmup and decay. Weight decay applies to the weight matrices only: not to norms, biases, the
    Gated DeltaNet's A_log and dt_bias (all vectors), nor to the embeddings."""
    trained, embedding = [p for p in model.parameters() if p.requires_grad], model.get_input_embeddings().weight
    decays = [p.ndim >= 2 and p is not embedding for p in trained]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p, decay in zip(trained, decays) if decay]},
            {"params": [p for p, decay in zip(trained, decays) if not decay], "weight_decay": 0.0},
        ],
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.weight_decay,
        fused=d.device.type == "cuda",
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))


def to_device(block: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in block.items()}


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process's peak; KiB on Linux


def alloc_retries() -> int:
    """How often CUDA's caching allocator has run out, freed its cache and retried, since the start."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0)


def filler_block(pad_id: int) -> dict:
    """What a rank whose data has run out feeds the model while other ranks still train: FSDP's collectives
    need every rank in every forward and backward. It has no loss tokens, so its loss and gradient are 0."""
    return {**make_block([([pad_id] * 16, [False] * 16)], 16, pad_id), "tokens": 0, "sum_sq_len": 0}


def global_counts(blocks: list[dict], d: Dist) -> dict:
    """Over all ranks: the most blocks any rank has (max_blocks), and the sums of blocks, loss tokens,
    non-padding tokens and squared segment lengths. One small all-reduce per step: the loss normaliser must
    be known before the first backward."""
    keys = ("blocks", "loss_tokens", "tokens", "sum_sq_len")
    rows = [[len(blocks), 0, 0, 0]] + [[0, *(b[k] for k in keys[1:])] for b in blocks]
    local = torch.tensor(rows, dtype=torch.float64, device=d.device).sum(0)
    max_blocks = local[:1].clone()
    dist.all_reduce(max_blocks, op=dist.ReduceOp.MAX)
    dist.all_reduce(local)
    return {"max_blocks": int(max_blocks), **{k: int(v) for k, v in zip(keys, local.tolist())}}


STOP = threading.Event()  # set by SIGTERM while training


def stop_requested(d: Dist) -> bool:
    """Whether any rank got SIGTERM (it reaches the ranks at different moments): every rank gets the same answer."""
    stop = torch.tensor(float(STOP.is_set()), device=d.device)
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    return bool(stop)


def run_blocks(model, blocks: list[dict], n_micro: int, filler: dict, cfg: Config, d: Dist, scale: float | None):
    """Forward (and backward when scale is given) over n_micro blocks, fillers after this rank's last one.
    The backward loss is sum(per-token CE) * scale; returns the detached sum of per-token losses."""
    loss_sum = torch.zeros((), device=d.device)
    for i in range(n_micro):
        block = to_device(blocks[i] if i < len(blocks) else filler, d.device)
        losses = model.token_losses(block, cfg.loss_chunk_tokens)
        if scale is not None:
            (losses.sum() * scale).backward()
        loss_sum += losses.detach().sum()
    return loss_sum


@dataclass
class Progress:
    """This rank's resumable state, saved with every checkpoint: the step, and where each data stream is."""

    step: int = 0
    streams: dict = dataclasses.field(default_factory=dict)  # slot -> StreamPosition of its last block taken
    next_slot: int = 0
    blocks: int = 0  # blocks this rank has trained on
    bad_steps: int = 0  # steps skipped for a non-finite loss or gradient norm
    bad_in_a_row: int = 0

    def blocks_of(self, items, num_workers: int):
        """The blocks among a loader's items, each item recorded as taken when the next block is asked for (a
        stream's end, which has no block, takes its turn in the DataLoader's order too)."""
        for item in items:
            self.streams[item["position"].slot] = item["position"]
            self.next_slot = (item["position"].slot + 1) % max(1, num_workers)
            if "input_ids" in item:
                self.blocks += 1
                yield item

    def stream_counts(self) -> Counter:
        """Conversations read, skipped (by reason) and truncated by this rank's streams so far."""
        return sum((Counter(p.counts_at_end) for p in self.streams.values()), Counter())

    @classmethod
    def from_state(cls, state: dict) -> Progress:  # the inverse of dataclasses.asdict, which a checkpoint stores
        if "streams" not in state:
            raise UserError(
                "the checkpoint was written by an older train.py (its data positions are a dict): "
                "resume it with that version, or start afresh in another output_dir"
            )
        return cls(**{**state, "streams": {s: StreamPosition(**p) for s, p in state["streams"].items()}})


@dataclass
class Job:
    """What a step, the loop and a checkpoint work on, built once by run()."""

    cfg: Config
    d: Dist
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total_steps: int
    progress: Progress
    filler: dict  # the block of a rank whose data has run out


def train_step(job: Job, blocks: list[dict], step_hook=None) -> dict:
    """One optimizer step over this rank's blocks, fillers once they run out. The loss is the global token
    mean: every rank's backward uses sum(per-token CE) * world_size / (loss tokens of this step over all
    ranks) -- FSDP averages gradients over ranks, so the world_size cancels and each loss token weighs the same
    wherever it sits. A NaN or inf anywhere reaches every rank's global gradient norm, so every rank skips the
    same steps. Returns the step's global counts, with its loss sum and gradient norm when it stepped; with
    max_blocks 0 (every rank's data has run out) or loss_tokens 0 (nothing to learn) it did not step."""
    from torch.distributed.tensor import DTensor

    cfg, d, progress, optimizer = job.cfg, job.d, job.progress, job.optimizer
    counts = global_counts(blocks, d)
    if counts["max_blocks"] == 0 or counts["loss_tokens"] == 0:
        return counts
    scale = d.world_size / counts["loss_tokens"]
    loss_sum = run_blocks(job.model, blocks, counts["max_blocks"], job.filler, cfg, d, scale)
    if step_hook:  # it may return a replacement loss sum (fault injection), or None
        replaced = step_hook(progress.step + 1, job.model, loss_sum)
        loss_sum = loss_sum if replaced is None else replaced
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
    finite = math.isfinite(grad_norm.item())  # .item() is a sync point, once a step
    if finite:
        optimizer.step()
        progress.bad_in_a_row = 0
    else:
        progress.bad_steps += 1
        progress.bad_in_a_row += 1
        step, row = progress.step + 1, f"{progress.bad_in_a_row} in a row, {progress.bad_steps} in all"
        print0(d.rank, f"step {step}: non-finite loss or gradient norm, optimizer step skipped ({row})")
    lr = optimizer.param_groups[0]["lr"]  # this step's, before the scheduler moves on
    job.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    progress.step += 1
    return {**counts, "loss_sum": loss_sum if finite else None, "grad_norm": grad_norm, "lr": lr}


# The share of a GPU's memory that activation_checkpointing: auto leaves unplanned: fragmentation, and peaks its
# baseline step does not show (NCCL's buffers grow with use, an eval's batch).
AUTO_RECOMPUTE_MARGIN = 0.1
# Steps in a row without an allocator retry that end auto's watch (RecomputeProbe.watch).
AUTO_RECOMPUTE_WATCH_STEPS = 10


def recompute_is_measured(cfg, device: torch.device) -> bool:
    """activation_checkpointing: auto on a GPU: the first steps measure and decide (RecomputeProbe)."""
    return recompute_share(cfg.activation_checkpointing) is None and device.type == "cuda"


class RecomputeProbe:
    """activation_checkpointing: auto, on GPUs. The first step runs with every layer recomputed while each layer's
    checkpointed forward is measured, in forward and again when backward recomputes it: the memory the
    recomputation leaves allocated (what the forward saves for backward; its output, which the next layer's input
    already holds, is not counted) and the time it takes. The second step still recomputes every layer, as any
    later step would (the first also compiles and autotunes): its peak, AdamW's state included, is the baseline.
    After it the ranks agree on the memory left: the device's (or the process's cap), less AUTO_RECOMPUTE_MARGIN
    of it and what other processes hold, less that peak; the smallest over the ranks. Then they keep the layers
    that save the most time per byte until it is spent, and watch the next steps for allocator retries (watch)."""

    def __init__(self, job: Job):
        self.job, self.layers = job, job.model.get_decoder().layers
        self.bytes, self.events, self.seconds = [0] * len(self.layers), [None] * len(self.layers), None
        self.kept, self.retries, self.clean_steps, self.reset_peak = None, 0, 0, False
        # transformers checkpoints a layer's forward (not its __call__: FSDP's hooks stay outside) through the
        # layer's _gradient_checkpointing_func; measuring inside it measures the recomputation too. FSDP has
        # all-gathered the layer's parameters before it runs and frees them after: neither is counted.
        self.checkpoint_funcs = [layer._gradient_checkpointing_func for layer in self.layers]
        for i, layer in enumerate(self.layers):
            layer._gradient_checkpointing_func = partial(self.checkpoint, i, self.checkpoint_funcs[i])

    def checkpoint(self, i: int, checkpoint_func, forward, *args):
        def measured(*args):
            start, allocated = torch.cuda.Event(enable_timing=True), torch.cuda.memory_allocated()
            start.record()
            output = forward(*args)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            outputs = output if isinstance(output, tuple) else (output,)
            kept = torch.cuda.memory_allocated() - allocated - sum(t.nbytes for t in outputs if torch.is_tensor(t))
            self.bytes[i] = max(self.bytes[i], kept)  # the recomputation's
            self.events[i] = (start, end)  # the last call's, a recomputation: the first includes compiling
            return output

        return checkpoint_func(measured, *args)

    def measuring(self):
        """The context of a step. In the measured one PyTorch's early stop is off: it would end a recomputation
        once it has the tensors backward needs, before the layer's forward returns; here it runs to the end."""
        if self.reset_peak:  # the baseline's peak starts here, after the measured step's log line read its own
            torch.cuda.reset_peak_memory_stats()
            self.reset_peak = False
        if self.seconds is None:
            return torch.utils.checkpoint.set_checkpoint_early_stop(False)
        return contextlib.nullcontext()

    def after_step(self, stepped: bool) -> bool:
        """Step 1 measures, step 2 decides, then it watches; True when done. Only steps that stepped the optimizer
        count (every rank agrees on which): one with nothing to learn runs no layer, and one skipped as non-finite
        may leave AdamW's state, which the baseline must hold, still to be created."""
        if not stepped:
            return False
        if self.seconds is None:
            torch.cuda.synchronize()
            for layer, checkpoint_func in zip(self.layers, self.checkpoint_funcs):
                layer._gradient_checkpointing_func = checkpoint_func
            self.seconds = [start.elapsed_time(end) / 1e3 for start, end in self.events]
            self.reset_peak = True
            return False
        if self.kept is None:
            self.decide()
            return False
        return self.watch()

    def decide(self) -> None:
        d, gib = self.job.d, 2**30
        free, total = torch.cuda.mem_get_info()
        limit = torch.cuda.get_per_process_memory_fraction() * total  # a cap set on this process, if any
        usable = min(free + torch.cuda.memory_reserved(), limit)
        peak = torch.cuda.max_memory_allocated()
        room = torch.tensor(usable - AUTO_RECOMPUTE_MARGIN * limit - peak, dtype=torch.float64, device=d.device)
        costs = torch.tensor([*self.bytes, *self.seconds], dtype=torch.float64, device=d.device)
        dist.all_reduce(costs, op=dist.ReduceOp.MAX)
        dist.all_reduce(room, op=dist.ReduceOp.MIN)
        n = len(self.layers)
        sizes, seconds = costs[:n].tolist(), costs[n:].tolist()
        self.kept = layers_to_keep(sizes, seconds, room.item())
        for i in self.kept:
            self.layers[i].gradient_checkpointing = False
        self.retries = alloc_retries()
        each = f"{sum(sizes) / n / gib:.2f} GiB and {1e3 * sum(seconds) / n:.0f} ms of recomputation per layer"
        print0(
            d.rank,
            f"activation_checkpointing auto: keeping the activations of {len(self.kept)} of {n} layers "
            f"{sorted(self.kept)} ({sum(sizes[i] for i in self.kept) / gib:.1f} GiB; measured {each}), recomputing "
            f"the rest; expected peak {(peak + sum(sizes[i] for i in self.kept)) / gib:.1f} GiB of {limit / gib:.1f}",
        )

    def watch(self) -> bool:
        """After a step in which CUDA's caching allocator ran out on any rank (it then frees its cache and retries
        the allocation, a stall: docs/BENCHMARKS.md, fourth round), the kept layer that saves the least time per
        byte is recomputed again. Done after AUTO_RECOMPUTE_WATCH_STEPS steps in a row without. Retries between
        steps (a log line, an eval, a save) count toward the next step."""
        retries = alloc_retries()
        new = torch.tensor(retries - self.retries, device=self.job.d.device)
        dist.all_reduce(new, op=dist.ReduceOp.MAX)
        self.retries, self.clean_steps = retries, self.clean_steps + 1
        if new.item() and self.kept:
            layer = self.kept.pop()
            self.layers[layer].gradient_checkpointing = True
            self.clean_steps = 0
            print0(
                self.job.d.rank,
                f"activation_checkpointing auto: step {self.job.progress.step} retried {new.item()} allocations: "
                f"recomputing layer {layer} again, keeping {len(self.kept)} {sorted(self.kept)}",
            )
        return self.clean_steps >= AUTO_RECOMPUTE_WATCH_STEPS


def layers_to_keep(sizes: list[float], seconds: list[float], room: float) -> list[int]:
    """The layers whose activations to keep, the most recompute time saved per byte first, while room lasts."""
    kept = []
    for i in sorted(range(len(sizes)), key=lambda i: -seconds[i] / max(sizes[i], 1)):
        if sizes[i] <= room:
            kept.append(i)
            room -= sizes[i]
    return kept


# Dense bf16 peak FLOP/s by device name, from NVIDIA's datasheets; MFU is shown only for these.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "B300": 2250e12, "A100": 312e12}


def matmul_params(model) -> int:
    """Parameters that cost 2 FLOPs per token each forward: the decoder layers and the LM head."""
    layers = sum(p.numel() for p in model.get_decoder().layers.parameters())
    return layers + model.get_output_embeddings().weight.numel()


def attention_flops_per_sq_token(model) -> int:
    """Training FLOPs per (segment length)^2 of the full-attention layers: causal QK^T and PV are
    2 * L^2 * heads * head_dim each over half the square, forward + backward = 3x forward: 6 * heads * dim.
    Gated DeltaNet's state updates (4 * d_k * d_v per head and token) are left out: under 0.5% at 27B."""
    text = model.config.get_text_config()
    full = sum(
        t != "linear_attention" for t in (getattr(text, "layer_types", None) or ["full"] * text.num_hidden_layers)
    )
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 6 * full * text.num_attention_heads * head_dim


class MetricsLog:
    """The log: rank 0 prints a fixed-field line per log interval and appends the same record to metrics.jsonl,
    and, when MLFLOW_RUN_ID (set by Databricks jobs and @distributed) or MLFLOW_TRACKING_URI is set, logs the
    resolved configuration as params and every number as a metric to that run. Secrets are never in either:
    the configuration holds none (HF_TOKEN is read from the environment by huggingface_hub only).

    A line sums the steps since the last one over all ranks; the loss is reduced only when a line is written
    (its .item() is a sync point). A line is written at every checkpoint too, so a checkpoint holds no window.
    last_loss: the last line's loss, the run's final loss."""

    def __init__(self, cfg: Config, d: Dist, model):
        self.cfg, self.d, self.mlflow, self.device = cfg, d, None, "gpu" if d.device.type == "cuda" else "cpu"
        if d.rank == 0 and (os.environ.get("MLFLOW_RUN_ID") or os.environ.get("MLFLOW_TRACKING_URI")):
            import mlflow

            run = mlflow.start_run(run_id=os.environ.get("MLFLOW_RUN_ID"))  # the platform's run, or a new one
            params = {k: str(v) for k, v in dataclasses.asdict(cfg).items()}
            # MLflow params cannot change: a resumed run logs only the ones its run does not have yet.
            mlflow.log_params({k: v for k, v in params.items() if k not in run.data.params})
            self.mlflow = mlflow
        self.path = Path(cfg.output_dir) / "metrics.jsonl"
        self.n_matmul, self.attn_per_sq = matmul_params(model), attention_flops_per_sq_token(model)
        name = torch.cuda.get_device_name() if d.device.type == "cuda" else ""
        self.peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        self.start = self.since = time.perf_counter()
        self.loss_sum, self.window, self.grad_norm = torch.zeros((), device=d.device), Counter(), None
        self.last_loss = None

    def add(self, stats: dict) -> None:
        """A step's counts, from train_step, into the window."""
        if stats["loss_sum"] is not None:  # a skipped step's loss is left out
            self.loss_sum += stats["loss_sum"]
            self.window["loss_tokens"] += stats["loss_tokens"]
        flops = 6 * self.n_matmul * stats["tokens"] + self.attn_per_sq * stats["sum_sq_len"]
        self.window.update(steps=1, flops=flops, blocks=stats["blocks"], tokens=stats["tokens"])
        self.window["data_wait_s"] += stats["data_wait_s"]
        self.grad_norm, self.lr = stats["grad_norm"], stats["lr"]

    def flush(self, job: Job) -> None:
        """Logs the window's line, checks the share of skipped records, starts afresh."""
        data = job.progress.stream_counts()
        reasons = skip_reasons(data)  # this rank's; the totals are over all ranks
        skipped = sum(reasons.values())
        skips = torch.tensor([skipped, skipped + data["conversations"]], device=self.d.device)
        dist.all_reduce(skips)
        dist.all_reduce(self.loss_sum)
        # A rank that waits for data, or for CUDA's allocator to free its cache and retry, stalls them all.
        retries = alloc_retries() if self.d.device.type == "cuda" else 0
        stalls = torch.tensor([self.window["data_wait_s"], retries], dtype=torch.float64, device=self.d.device)
        dist.all_reduce(stalls, op=dist.ReduceOp.MAX)
        now, c, step, ranks = time.perf_counter(), self.window, job.progress.step, self.d.world_size
        seconds, capacity = now - self.since, c["blocks"] * self.cfg.max_seq_len
        cuda = self.d.device.type == "cuda"  # memory: the GPU's peak allocated; on CPU the peak RSS (KiB on Linux)
        r = {
            "step": step,
            "total_steps": job.total_steps,
            "loss": self.loss_sum.item() / max(c["loss_tokens"], 1),
            "lr": self.lr,  # the last step's
            "grad_norm": self.grad_norm.item(),
            "tokens_per_s_per_gpu": c["tokens"] / seconds / ranks,
            "loss_tokens_per_s_per_gpu": c["loss_tokens"] / seconds / ranks,
            "non_padding_fraction": c["tokens"] / capacity,
            "loss_token_fraction": c["loss_tokens"] / capacity,
            "mfu": c["flops"] / seconds / ranks / self.peak if self.peak else None,
            "memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else rss_gib(),
            "data_wait_s": float(stalls[0]),  # the window's time waiting for blocks, on the rank that waited longest
            "alloc_retries": int(stalls[1]),  # since the start: CUDA caching-allocator retries, the most on a rank
            "eta_s": (job.total_steps - step) * seconds / c["steps"],
            "skipped_records": int(skips[0]),
            "bad_steps": job.progress.bad_steps,
            "elapsed_s": now - self.start,
            "time": time.time(),
        }
        mfu, unit = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-", self.device
        print0(
            self.d.rank,
            f"step {step}/{r['total_steps']} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | grad {r['grad_norm']:.3f} "
            f"| {r['tokens_per_s_per_gpu']:,.0f} tok/s/{unit} | {r['loss_tokens_per_s_per_gpu']:,.0f} loss-tok/s/{unit}"
            f" | mfu {mfu} | mem {r['memory_gib']:.1f} GiB | eta {timedelta(seconds=int(r['eta_s']))}",
        )
        self.write(r)
        check_skips(int(skips[0]), int(skips[1]), {"on this rank": reasons}, self.cfg)
        self.since, self.window, self.last_loss = now, Counter(), r["loss"]
        self.loss_sum.zero_()

    def write(self, record: dict) -> None:
        if self.d.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.mlflow:
            flat = {}
            for key, value in record.items():
                for name, v in value.items() if isinstance(value, dict) else [("", value)]:
                    if isinstance(v, (int, float)) and key not in ("step", "total_steps", "time"):
                        flat[f"{key}/{name}" if name else key] = v
            try:  # a tracking-server hiccup must not end a week-long run
                self.mlflow.log_metrics(flat, step=record["step"])
            except Exception as e:
                print(f"warning: MLflow log_metrics failed ({e}); metrics.jsonl has the record", flush=True)

    def close(self, status: str) -> None:
        """status: FINISHED, or FAILED when the run ends with an error (a job's run must not read as a success)."""
        if self.mlflow:
            self.mlflow.end_run(status=status)


class Evaluator:
    """Token-weighted loss on the first eval_blocks blocks of each rank's shard of the held-out data; last_loss,
    the last eval's."""

    def __init__(self, cfg: Config, tokenizer, d: Dist, filler: dict):
        self.cfg, self.d, self.filler, self.last_loss = cfg, d, filler, None
        # A few blocks, read once: no worker, and a buffer of only those blocks (with eval_fraction, reading the
        # held-out records for pack_buffer_blocks blocks would mean reading that much more training data).
        in_process = dataclasses.replace(cfg, num_workers=0, pack_buffer_blocks=cfg.eval_blocks)
        loader = block_loader(in_process, tokenizer, "eval", d.rank, d.world_size, epochs=1)
        self.blocks = list(itertools.islice((b for b in loader if "input_ids" in b), cfg.eval_blocks))
        counts = global_counts(self.blocks, d)
        self.n_micro, self.loss_tokens = counts["max_blocks"], counts["loss_tokens"]
        if self.loss_tokens == 0:
            raise UserError(f"the eval data ({data_source(cfg, 'eval')}) yields no loss tokens")

    @torch.no_grad()
    def __call__(self, model, step: int, log: MetricsLog) -> None:
        model.eval()
        loss_sum = run_blocks(model, self.blocks, self.n_micro, self.filler, self.cfg, self.d, scale=None)
        model.train()
        dist.all_reduce(loss_sum)
        loss = loss_sum.item() / self.loss_tokens
        print0(self.d.rank, f"eval step {step} | loss {loss:.4f}")
        log.write({"step": step, "eval_loss": loss})
        self.last_loss = loss


@contextlib.contextmanager
def stop_on_sigterm():
    """While training, SIGTERM asks the loop to save and stop (STOP) instead of ending the process at once. Before,
    there is nothing to save, and it ends the process as usual."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: STOP.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        late = STOP.is_set()
        STOP.clear()
    if late:  # during the final eval or save, after the last check: the export is left to the restart
        raise Interrupted("stopped by SIGTERM after the last step; its checkpoint, if any, is complete")


class Interrupted(Exception):
    """SIGTERM (a scheduler's stop, a preemption notice) reached a rank; raised on every rank once the step in
    progress is done and its checkpoint complete. main() exits with 128 + SIGTERM, as a process killed by it."""


def training_loop(
    job: Job, blocks, log: MetricsLog, evaluator: Evaluator | None, checkpoints: Checkpointer, step_hook=None
) -> bool:
    """Steps until total_steps, until every rank's data has run out (a rank that runs out first feeds fillers until
    all have), or until SIGTERM reaches any rank (then every rank finishes its step); logs every log_every steps,
    evaluates every eval_every, saves every save_every. Returns whether SIGTERM stopped it. blocks: this rank's
    block iterator, started at job.progress."""
    cfg, d, progress, total_steps = job.cfg, job.d, job.progress, job.total_steps
    data = progress.blocks_of(blocks, cfg.num_workers)  # a generator: an exhausted one may be asked again
    probe = RecomputeProbe(job) if recompute_is_measured(cfg, d.device) else None
    job.model.train()
    while progress.step < total_steps:
        if stop_requested(d):  # before any block of the next step is taken: the checkpoint resumes there
            print0(d.rank, f"SIGTERM: stopping after step {progress.step}, once its checkpoint is written")
            return True
        waiting = time.perf_counter()
        step_blocks = list(itertools.islice(data, cfg.gradient_accumulation_steps))
        waiting = time.perf_counter() - waiting
        with probe.measuring() if probe else contextlib.nullcontext():
            stats = train_step(job, step_blocks, step_hook)
        if probe and probe.after_step(stepped=stats.get("loss_sum") is not None):
            probe = None
        checkpoints.after_step()
        if progress.bad_in_a_row >= cfg.max_bad_steps:  # every rank agrees: they share the gradient norm
            checkpoints.finish()  # the write in flight holds a state from before these steps: keep it
            raise UserError(
                f"{cfg.max_bad_steps} steps in a row with a non-finite loss or gradient norm at step {progress.step}: "
                f"stopping. The last checkpoint is {checkpoints.newest()}; lower learning_rate or look at the data"
            )
        if stats["max_blocks"] == 0:
            print0(d.rank, f"data exhausted on every rank after {progress.step} of {total_steps} steps")
            return False
        if stats["loss_tokens"] == 0:
            continue
        log.add({**stats, "data_wait_s": waiting})
        step = progress.step
        save = checkpoints.due(step) and step < total_steps
        if step % cfg.log_every == 0 or step == total_steps or save:
            log.flush(job)
        if evaluator and cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
            evaluator(job.model, step, log)
        if save:
            checkpoints.save()
    return False


def finish_training(
    job: Job, log: MetricsLog, evaluator: Evaluator | None, checkpoints: Checkpointer, stopped: bool
) -> dict:
    """After the loop: the last log line, the final eval, the final save (the export is left to a restart when
    SIGTERM stopped the loop, which raises Interrupted once the checkpoint is complete)."""
    progress = job.progress
    if progress.step == 0:  # every rank agrees: e.g. max_steps given, and every conversation truncated to nothing
        seen = dict(progress.stream_counts())
        raise UserError(f"no step was trained: the data holds nothing to learn from (rank {job.d.rank}: {seen})")
    if log.window["steps"]:  # the data ran out between log lines: log the rest before the final save
        log.flush(job)
    if evaluator and not stopped:
        evaluator(job.model, progress.step, log)
    if job.cfg.save_every >= 0 and progress.step != checkpoints.saved_step:
        checkpoints.save()
    checkpoints.finish()  # the write in flight finishes and its checkpoint completes
    if stopped:
        raise Interrupted(
            f"stopped by SIGTERM after step {progress.step}; the newest checkpoint is {checkpoints.newest()}"
        )
    return {"steps": progress.step, "final_loss": log.last_loss, "eval_loss": evaluator and evaluator.last_loss}


# ------------------------------------------------------------------------------------------------------------
# 6. Checkpoints, resume and the Hugging Face export
# ------------------------------------------------------------------------------------------------------------


def check_output_dir(cfg: Config, d: Dist) -> Path:
    """Every rank writes its checkpoint shards to output_dir: make sure each can, before anything is loaded."""
    out = Path(cfg.output_dir)
    probe = out / f".write-test-rank{d.rank}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UserError(
            f"output_dir {out} is not writable from rank {d.rank} ({e.strerror}): set output_dir "
            "to a directory (or Unity Catalog volume path) this job can write"
        ) from e
    return out


class RunLock(contextlib.AbstractContextManager):
    """output_dir/run.lock, held by rank 0 of the run training into output_dir: its host, pid and start time,
    refreshed every 30 s. Two runs on one output_dir would write the same checkpoints and log every line twice:
    a second run refuses at start, naming the holder. A dead holder's lock is taken over: its pid is gone on this
    host, or it has not been refreshed for 2 minutes (a holder on another host)."""

    REFRESH_S, STALE_S = 30, 120

    def __init__(self, out: Path, d: Dist):
        self.path, self.d, self.released = out / "run.lock", d, threading.Event()
        self.me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "run": os.urandom(8).hex(),  # this run's, whatever pid a restarted container gives it
        }
        decided_by_rank_0(self.acquire, f"cannot take the lock {self.path}", d)
        if d.rank == 0:
            threading.Thread(target=self.refresh, name="run-lock", daemon=True).start()

    def acquire(self) -> None:
        """Takes the lock, or raises a UserError naming who holds it."""
        try:
            lock = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # of two runs at once, one creates it
            os.write(lock, json.dumps(self.me).encode())
            os.close(lock)
        except FileExistsError:
            try:  # a lock file written halfway (its writer died at once) is no lock
                holder = json.loads(self.path.read_text())
                age, host, pid = time.time() - self.path.stat().st_mtime, holder["host"], int(holder["pid"])
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                holder = None
            if holder:
                # Our own pid there: a container restarted under its old one.
                pid_gone = host == self.me["host"] and (pid == os.getpid() or not pid_alive(pid))
                if not pid_gone and age < self.STALE_S:
                    raise UserError(
                        f"output_dir {self.path.parent} is in use by another run (host {host}, pid {pid}, started "
                        f"{holder.get('started')}, alive {age:.0f}s ago): use another output_dir, or remove "
                        f"{self.path} if that run is gone"
                    ) from None
                print(f"taking over the lock of a run that is gone: {holder}", flush=True)
            tmp = self.path.with_name(f"run.lock.{self.me['run']}")
            tmp.write_text(json.dumps(self.me))
            os.replace(tmp, self.path)
        time.sleep(0.2)  # two runs that took the lock at once (one over the other's half-written file): one stays
        if json.loads(self.path.read_text()) != self.me:
            raise UserError(f"output_dir {self.path.parent} was just taken")

    def refresh(self) -> None:
        while not self.released.wait(self.REFRESH_S):
            with contextlib.suppress(OSError):  # a file system hiccup: the next refresh may do
                os.utime(self.path)

    def __exit__(self, *exc) -> None:
        if self.d.rank == 0:
            self.released.set()
            with contextlib.suppress(OSError, ValueError):
                if json.loads(self.path.read_text()) == self.me:
                    self.path.unlink()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        pass
    return True


def complete_checkpoints(cfg: Config) -> list[Path]:
    """Checkpoints every rank finished writing, oldest first. complete.json is written last, by rank 0, after
    a barrier: a directory without it is an interrupted save and is never loaded."""
    root = Path(cfg.output_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if (p / "complete.json").exists())


def checkpoint_meta(path: Path) -> dict:
    """A complete checkpoint's complete.json: step, total_steps, world_size, scheduler, config, files (name: size),
    sha256 (of the small files), bytes, seconds."""
    return json.loads((path / "complete.json").read_text())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with a complete checkpoint, checked against its complete.json, or None. (A complete.json
    written before files and hashes were recorded has nothing to check against.)"""
    try:
        meta = checkpoint_meta(path)
        for name, size in meta.get("files", {}).items():
            if (path / name).stat().st_size != size:
                return f"{name} has {(path / name).stat().st_size} bytes, {size} were written"
        for name, digest in meta.get("sha256", {}).items():
            if sha256(path / name) != digest:
                return f"{name} differs from what was written"
    except (FileNotFoundError, ValueError, AttributeError, TypeError) as e:  # a missing file, a broken complete.json
        return f"{type(e).__name__}: {e}"
    return None


def resume_point(cfg: Config, d: Dist) -> Path | None:
    """The newest complete checkpoint that passes checkpoint_problem. One that fails is named and set aside
    (renamed rejected-step_N-<time>, kept for a look), and the one before it is tried; if every one fails, the
    run stops (started again, it starts afresh). Rank 0 decides, for all: ranks must not take different branches
    on their own views of a (possibly cached, possibly node-local) file system."""

    def newest_intact() -> Path | None:
        candidates = complete_checkpoints(cfg)
        for path in reversed(candidates):
            problem = checkpoint_problem(path)
            if not problem:
                return path
            aside = path.with_name(f"rejected-{path.name}-{time.strftime('%Y%m%d-%H%M%S')}")
            path.rename(aside)
            print(f"warning: checkpoint {path} is damaged ({problem}): set aside as {aside.name}", flush=True)
        if candidates:
            raise UserError(f"every checkpoint in {path.parent} is damaged (set aside as rejected-*); start again")
        return None

    return decided_by_rank_0(newest_intact, f"cannot read the checkpoints in {cfg.output_dir}", d)


def decided_by_rank_0(decide, failure: str, d: Dist):
    """decide() on rank 0 alone, its result for every rank. Its UserError, or a failure of the file system there
    (named by `failure`), is raised on every rank: no rank waits in a collective for one that has left."""
    outcome = [None, None]  # (result, error)
    if d.rank == 0:
        try:
            outcome[0] = decide()
        except UserError as e:
            outcome[1] = str(e)
        except (OSError, ValueError) as e:
            outcome[1] = f"{failure}: {e}"
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1]:
        raise UserError(outcome[1])
    return outcome[0]


def walk_tensors(value, fn, key: tuple = ()):
    """A copy of a nested dict/list state with each tensor replaced by fn(its key path, the tensor)."""
    if isinstance(value, dict):
        return {k: walk_tensors(v, fn, (*key, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [walk_tensors(v, fn, (*key, i)) for i, v in enumerate(value)]
    if isinstance(value, torch.Tensor):
        return fn(key, value)
    return value


class Staged(AsyncStager):
    """For dcp.async_save: the state is staged already (Checkpointer.stage), so there is nothing to copy."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class Checkpointer:
    """Sharded DCP checkpoints of the model and AdamW state (each rank writes its own shards), each rank's Progress
    and RNG states, then complete.json (step, scheduler, configuration), written by rank 0 only once every rank's
    write has finished: a crash during a write leaves the previous checkpoint the newest complete one.

    async_save: each rank first copies its state to host memory (pinned on GPUs; the training stall), then a
    background thread writes it while training goes on; after each step the ranks check together whether every
    write has finished, and then complete.json is written. One write at a time: a save, and the end of the run,
    wait for the one in flight. The background writes coordinate over a gloo group of their own, so their
    collectives never interleave with training's."""

    def __init__(self, job: Job):
        self.job, self.pending, self.last, self.buffers, self.preparing = job, None, time.monotonic(), {}, None
        self.saved_step = job.progress.step or None  # a resumed run starts at a saved step
        if job.cfg.async_save and job.cfg.save_every >= 0:
            self.group = dist.new_group(backend="gloo")
            # The staged copy in host memory, per rank and per node (weights, and AdamW's two moments of the
            # trained ones), stated against the node's memory.
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", job.d.world_size))
            rank_bytes = sum(p.to_local().nbytes * (3 if p.requires_grad else 1) for p in job.model.parameters())
            node, gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 2**30
            swap = ranks * rank_bytes > 0.8 * node
            warn = " -- over 80% of it: expect swapping, or set async_save: false" if swap else ""
            print0(
                job.d.rank,
                f"async_save: {rank_bytes / gib:.1f} GiB of host memory per rank for the staged checkpoint, "
                f"{ranks * rank_bytes / gib:.1f} GiB on this node of {node / gib:.0f} GiB{warn}",
            )

    def due(self, step: int) -> bool:
        """Whether to save after this step: every save_every steps, or save_every_minutes after the last save (rank
        0's clock decides, so that every rank saves the same steps)."""
        cfg, d = self.job.cfg, self.job.d
        if cfg.save_every > 0 and step % cfg.save_every == 0:
            return True
        if not cfg.save_every_minutes or cfg.save_every < 0:
            return False
        late = torch.tensor(time.monotonic() - self.last >= 60 * cfg.save_every_minutes, device=d.device)
        dist.broadcast(late, src=0)
        return bool(late)

    def state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.job.model, self.job.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def save(self) -> None:
        self.finish()  # the write in flight, if any
        job, d, progress = self.job, self.job.d, self.job.progress
        t0 = time.perf_counter()
        path = Path(job.cfg.output_dir) / "checkpoints" / f"step_{progress.step:08d}"
        if d.rank == 0 and path.exists():
            shutil.rmtree(path)  # an earlier, interrupted save of this step
        dist.barrier()
        path.mkdir(parents=True, exist_ok=True)  # a background write creates it only later
        state = self.state()
        future = None
        if job.cfg.async_save:  # the copy must be taken before the next step changes the weights
            staged = self.stage(state)
            future = dcp.async_save(staged, checkpoint_id=str(path), process_group=self.group, async_stager=Staged())
        else:
            dcp.save(state, checkpoint_id=str(path))
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if d.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(d.device)
        torch.save({"progress": dataclasses.asdict(progress), "rng": rng}, path / f"rank_{d.rank:05d}.pt")
        meta = {
            "step": progress.step,
            "total_steps": job.total_steps,
            "world_size": d.world_size,
            "scheduler": job.scheduler.state_dict(),
            "config": dataclasses.asdict(job.cfg),
        }
        self.pending, self.last = (future, path, meta, t0, time.perf_counter() - t0), time.monotonic()
        self.saved_step = progress.step
        if not future:
            self.finish()

    def prepare(self) -> None:
        """Called after each step; after the first (AdamW's state exists from then on) it allocates and pins the
        staging buffers in a background thread, so that the first save stalls training for a copy too, not for
        the seconds that allocating and pinning tens of GB take (docs/CHECKPOINTS.md)."""
        cfg, optimizer = self.job.cfg, self.job.optimizer
        if self.preparing or self.buffers or not optimizer.state or not cfg.async_save or cfg.save_every < 0:
            return
        from torch.distributed.tensor import DTensor

        layout = []  # each rank-local tensor's shape and dtype, taken here: the thread reads no live state

        def note(key, value):
            local = value.to_local() if isinstance(value, DTensor) else value
            layout.append((key, local.shape, local.dtype))

        walk_tensors(self.state(), note)
        self.preparing = threading.Thread(target=lambda: [self.buffer(*leaf) for leaf in layout], daemon=True)
        self.preparing.start()

    def buffer(self, key: tuple, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The host buffer kept for one tensor of the state, pinned in place on GPUs (PyTorch's pinned allocator
        would round each up to a power of 2)."""
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            buffer = torch.empty(shape, dtype=dtype)
            if self.job.d.device.type == "cuda" and buffer.nbytes:
                cudart = torch.cuda.cudart()
                cudart.cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0)
                weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
            self.buffers[key] = buffer
        return buffer

    @torch.no_grad()
    def stage(self, state: dict) -> dict:
        """The state with every tensor copied into its host buffer (prepare; docs/CHECKPOINTS.md measures the copy).
        Sharded tensors keep their placements, over a CPU mesh of the checkpoint group, so the files are those a
        save from the GPU writes. (DCP's own stager caches its buffers too, but on torch 2.11 its second save
        failed.)"""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor

        if self.preparing:  # the first save, if it comes before the buffers are ready, waits for them
            self.preparing.join()
            self.preparing = None
        pinned = self.job.d.device.type == "cuda"
        self.mesh = getattr(self, "mesh", None) or DeviceMesh.from_group(self.group, "cpu")

        def host(key, value):
            local = value.to_local() if isinstance(value, DTensor) else value
            buffer = self.buffer(key, local.shape, local.dtype)
            buffer.copy_(local, non_blocking=pinned)
            if not isinstance(value, DTensor):
                return buffer
            shape, stride = value.shape, value.stride()
            return DTensor.from_local(buffer, self.mesh, value.placements, run_check=False, shape=shape, stride=stride)

        staged = walk_tensors(state, host)
        if pinned:
            torch.cuda.synchronize()
        return staged

    def after_step(self) -> None:
        """After each step: while a write is in flight, once every rank's has finished, complete the checkpoint;
        after the first step, prepare the staging buffers."""
        if self.pending and self.pending[0]:
            running = torch.tensor(int(not self.pending[0].done()), device=self.job.d.device)
            dist.all_reduce(running)
            if not running:
                self.finish()
        self.prepare()

    def newest(self) -> str:
        """The newest complete checkpoint, for a message."""
        never = "none (save_every: -1)" if self.job.cfg.save_every < 0 else "none"
        return str((complete_checkpoints(self.job.cfg) or [never])[-1])

    def finish(self) -> None:
        """Waits for the write in flight, then rank 0 writes complete.json and removes what is no longer kept."""
        if not self.pending:
            return
        (future, path, meta, t0, stall), cfg = self.pending, self.job.cfg
        if future:
            future.result()  # raises what the write raised
        dist.barrier()  # every rank has written its part
        self.pending = None
        if self.job.d.rank == 0:
            files = {f.name: f.stat().st_size for f in sorted(path.iterdir())}
            # What a resume verifies cheaply: every file's size, and the hash of each small one (.metadata, ranks').
            small = {name: sha256(path / name) for name, size in files.items() if size < 2**26}
            meta.update(files=files, sha256=small, bytes=sum(files.values()), seconds=time.perf_counter() - t0)
            (path / "complete.json.tmp").write_text(json.dumps(meta, indent=1))
            os.replace(path / "complete.json.tmp", path / "complete.json")
            complete = complete_checkpoints(cfg)
            for old in complete[: -cfg.keep_checkpoints]:
                shutil.rmtree(old)
            for unfinished in (p for p in path.parent.glob("step_*") if p not in complete and p.name < path.name):
                shutil.rmtree(unfinished)
            print(
                f"checkpoint step {meta['step']}: {meta['bytes'] / 2**30:.2f} GiB in {meta['seconds']:.1f}s "
                f"(training stalled {stall:.1f}s) -> {path}",
                flush=True,
            )


def resume_progress(path: Path, meta: dict, cfg: Config, d: Dist) -> Progress:
    """Checks that this configuration can resume the checkpoint at path and returns this rank's Progress, RNG
    states restored. Needs no model, so the data stream can restart while the weights load."""
    if meta["world_size"] != d.world_size:
        raise UserError(
            f"{path} was written by {meta['world_size']} ranks; resume with as many, or use another output_dir"
        )
    fixed = fixed_on_resume(meta["config"], cfg)
    if fixed:
        changes = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in sorted(fixed.items()))
        raise UserError(
            f"{path} was written with other {sorted(fixed)} ({changes}): a resumed run keeps the data layout, the "
            "batch and the optimizer of its checkpoint. Restore them, or use another output_dir"
        )
    changed = {k: v for k, v in dataclasses.asdict(cfg).items() if meta["config"].get(k) != v}
    if changed:
        print0(d.rank, f"resuming with configuration changes: {changed}")
    saved = torch.load(path / f"rank_{d.rank:05d}.pt", weights_only=False)  # our own file: RNG tuples
    torch.set_rng_state(saved["rng"]["torch"])
    random.setstate(saved["rng"]["python"])
    if "cuda" in saved["rng"]:
        torch.cuda.set_rng_state(saved["rng"]["cuda"], d.device)
    return Progress.from_state(saved["progress"])


def resume_weights(path: Path, meta: dict, model, optimizer, scheduler, d: Dist) -> None:
    """Loads the checkpoint's model, optimizer and LR scheduler states into the sharded model and optimizer."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    t0 = time.perf_counter()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    scheduler.load_state_dict(meta["scheduler"])
    seconds = time.perf_counter() - t0
    print0(d.rank, f"resumed from {path} (step {meta['step']} of {meta['total_steps']}) in {seconds:.1f}s")


# A source checkpoint's tokenizer files: the export has the tokenizer trained with instead (tokenizer_name's).
TOKENIZER_FILES = """tokenizer.json tokenizer_config.json special_tokens_map.json added_tokens.json chat_template.jinja
chat_template.json vocab.json merges.txt tokenizer.model tokenizer.model.v3 spiece.model tekken.json""".split()


def stop_at_end_of_turn(out: Path, tokenizer, model_config) -> None:
    """generation_config.json's eos_token_id gains the tokenizer's eos and the token its chat template ends an
    assistant turn with, so generate() and servers stop where the fine-tuned model learned to end its answer
    (Llama 3.1 base weights with the Instruct tokenizer: <|eot_id|>, not only the base's <|end_of_text|>)."""
    from transformers import GenerationConfig

    path = out / "generation_config.json"
    config = (
        GenerationConfig.from_pretrained(out) if path.exists() else GenerationConfig.from_model_config(model_config)
    )
    eos = {*(config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id])}
    turn = AssistantMasker(tokenizer)([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    if not isinstance(turn, str):  # the last token of an assistant turn's loss span is its end-of-turn token
        ids, mask = turn
        eos.add(ids[max(i for i, m in enumerate(mask) if m)])
    config.eos_token_id = sorted((eos | {tokenizer.eos_token_id}) - {None})
    config.save_pretrained(out)


def export_hf(model, tokenizer, source: Path, source_dtypes: dict, cfg: Config, d: Dist) -> Path:
    """Writes output_dir/model: a consolidated Hugging Face checkpoint that from_pretrained loads as is.

    Each rank writes its own shards (cast back to the source checkpoint's dtype per tensor), which DCP then
    consolidates file by file into the source's file layout: no rank gathers the model. Tensors the model
    has no module for (mtp.* heads) are copied from the source unchanged, and so are its configuration and
    processor files; the tokenizer is the one trained with.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    t0 = time.perf_counter()
    out = Path(cfg.output_dir) / "model"
    if d.rank == 0 and out.exists():
        shutil.rmtree(out)
    dist.barrier()
    index_file = source / "model.safetensors.index.json"
    source_files = json.loads(index_file.read_text())["weight_map"] if index_file.exists() else {}
    file_number = {name: n for n, name in enumerate(sorted(set(source_files.values())), 1)}
    state = {k: v.to(source_dtypes[k]) for k, v in model.state_dict().items() if k in source_dtypes}
    layout = {k: file_number.get(source_files.get(k), 1) for k in state}
    kwargs = dict(save_distributed=True, enable_consolidation=True, thread_count_consolidation=8)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=layout, **kwargs))
    dist.barrier()
    if d.rank == 0:
        shutil.rmtree(out / "sharded")
        extra = sorted(set(source_dtypes) - set(state))
        if extra:  # e.g. mtp.*: copied as they are, into a file of their own listed in the index
            tensors = {}
            for name in extra:
                with safe_open(source / source_files.get(name, "model.safetensors"), "pt") as f:
                    tensors[name] = f.get_tensor(name)
            save_file(tensors, out / "model-extra.safetensors", metadata={"format": "pt"})
            index = json.loads((out / "model.safetensors.index.json").read_text())
            index["weight_map"].update(dict.fromkeys(extra, "model-extra.safetensors"))
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        for f in source.iterdir():  # config.json, generation_config.json, processor configs; not the tokenizer's
            tokenizer_file = f.name in TOKENIZER_FILES or f.suffix == ".tiktoken"
            if f.is_file() and f.suffix != ".safetensors" and f.name != index_file.name and not tokenizer_file:
                shutil.copy(f, out / f.name)
        tokenizer.save_pretrained(out)  # the tokenizer trained with: its special tokens and chat template
        stop_at_end_of_turn(out, tokenizer, model.config)
        size, seconds = sum(f.stat().st_size for f in out.iterdir()) / 2**30, time.perf_counter() - t0
        print(f"exported {len(state) + len(extra)} tensors, {size:.2f} GiB in {seconds:.1f}s -> {out}", flush=True)
    dist.barrier()
    return out


# ------------------------------------------------------------------------------------------------------------
# 7. Entry points: train(config) for notebooks and torchrun, main()
# ------------------------------------------------------------------------------------------------------------


def train(config: Config | dict | str | Path | None = None, step_hook=None) -> dict:
    """Runs the whole job in this rank's process and returns {final_loss, eval_loss, steps, output_dir, model_dir}.

    torchrun calls it through main(); a notebook's @distributed function calls it directly in each rank's
    process, with RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* already set. config: a Config, a dict (checked key by key
    like a YAML file), or the path of a YAML file. An existing process group is used and left open; one
    created here is destroyed here. step_hook(step, model, loss_sum) -> loss_sum runs on every rank after each
    step's backward, before clipping (fault injection in the tests, custom monitoring).
    """
    if isinstance(config, (str, Path)):
        config = load_config(yaml_source(config, "train()"))
    elif not isinstance(config, Config):
        config = load_config(("train()", config or {}))
    d = setup_distributed()
    try:
        with RunLock(on_every_rank(partial(check_output_dir, config, d), d), d):
            return run(config, d, step_hook)
    finally:
        if d.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def startup_checks(cfg: Config, d: Dist):
    """Everything that can be checked without the weights, checked first: the attention backend, the model's
    config, kernels and settings, the tokenizer, the data. Returns (attention, model config, tokenizer)."""
    attn = resolve_attention(cfg.attn_implementation, d.device)
    config = model_config(cfg.model_name, cfg.model_revision, cfg.trust_remote_code)
    require_kernels(config)
    check_model_settings(config, cfg, d.device)
    tokenizer = load_tokenizer(cfg)
    for part in ["train"] + (["eval"] if cfg.eval_split else []):
        check_data(cfg, part)
    return attn, config, tokenizer


def run(cfg: Config, d: Dist, step_hook=None) -> dict:
    import transformers

    torch.manual_seed(cfg.seed)
    print0(d.rank, f"configuration:\n{yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)}")
    attn, config, tokenizer = on_every_rank(partial(startup_checks, cfg, d), d)
    resume_from = resume_point(cfg, d)
    meta = checkpoint_meta(resume_from) if resume_from else None
    progress = resume_progress(resume_from, meta, cfg, d) if meta else Progress()
    if d.rank == 0:  # the settings of this run, once they are known to be usable
        (Path(cfg.output_dir) / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    total_steps, stats = step_count(cfg, tokenizer, d, meta)
    # The data stream starts now: its worker packs the first buffer while the weights load.
    blocks = iter(block_loader(cfg, tokenizer, "train", d.rank, d.world_size, cfg.epochs, progress))
    source = on_every_rank(partial(pretrained_dir, cfg), d)
    t0 = time.perf_counter()
    model = build_model(config, cfg, attn, d.device)
    # The dtype each tensor is exported in: the checkpoint's; with random weights, the compute dtype.
    if cfg.init == "pretrained":
        source_dtypes = checkpoint_dtypes(source)
    else:
        source_dtypes = dict.fromkeys(model.state_dict(), getattr(torch, cfg.param_dtype))
    optimizer, scheduler = make_optimizer(model, cfg, d, total_steps)
    if meta:
        resume_weights(resume_from, meta, model, optimizer, scheduler, d)
    elif cfg.init == "pretrained":
        load_pretrained(model, source, source_dtypes)
    else:
        init_random(model, cfg.seed)
    layers = model.get_decoder().layers
    recomputed = f"{sum(getattr(layer, 'gradient_checkpointing', False) for layer in layers)} recomputed"
    if recompute_is_measured(cfg, d.device):
        recomputed += " until activation_checkpointing auto decides"
    print0(
        d.rank,
        f"model: {config.model_type}, {sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M parameters, "
        f"{len(layers)} decoder layers ({recomputed}{', norms and MLPs compiled' if cfg.compile else ''}), "
        f"attention {attn}, sharded over {d.world_size} ranks, {cfg.init} weights, ready in "
        f"{time.perf_counter() - t0:.1f}s, peak host memory {rss_gib():.1f} GiB on rank 0\n"
        f"derived: world_size {d.world_size} | device {d.device.type} | steps {total_steps} | tokens per step "
        f"{cfg.gradient_accumulation_steps * d.world_size * cfg.max_seq_len:,} | torch {torch.__version__} | "
        f"transformers {transformers.__version__}",
    )
    log, status = MetricsLog(cfg, d, model), "FAILED"
    try:
        if stats:
            log.write({"step": 0, "packing": stats})
        job = Job(cfg, d, model, optimizer, scheduler, total_steps, progress, filler_block(pad_token_id(tokenizer)))
        evaluator = Evaluator(cfg, tokenizer, d, job.filler) if cfg.eval_split or cfg.eval_fraction else None
        with stop_on_sigterm():
            checkpoints = Checkpointer(job)
            stopped = training_loop(job, blocks, log, evaluator, checkpoints, step_hook)
            result = finish_training(job, log, evaluator, checkpoints, stopped)
        seen = [None] * d.world_size
        dist.all_gather_object(seen, progress.stream_counts() + Counter(blocks=progress.blocks))
        summary = dict(sum(seen, Counter()))
        trained = f"final loss {result['final_loss']}" if result["final_loss"] is not None else "none in this run"
        print0(d.rank, f"done: {result['steps']} steps, {trained}, data seen {summary}")
        log.write({"step": result["steps"], "data_seen": summary})
        export = export_hf(model, tokenizer, source, source_dtypes, cfg, d) if cfg.export else None
        status = "FINISHED"
    except Interrupted:
        status = "KILLED"  # MLflow's word for a run stopped from outside
        raise
    finally:
        log.close(status)
    return {**result, "output_dir": cfg.output_dir, "model_dir": str(export) if export else None}


def main(argv: list[str] | None = None) -> None:
    try:
        train(parse_args(sys.argv[1:] if argv is None else argv)[0])
    except (UserError, Interrupted) as e:  # every rank raises it; one line is enough
        print0(int(os.environ.get("RANK", "0")), f"error: {e}" if isinstance(e, UserError) else str(e), file=sys.stderr)
        sys.exit(2 if isinstance(e, UserError) else 128 + signal.SIGTERM)


if __name__ == "__main__":
    main()
