#!/usr/bin/env python3
"""Supervised fine-tuning of a causal LM with plain PyTorch FSDP2: one file, launched by torchrun.

Default job: Qwen/Qwen3.8-27B (qwen3_5: Gated DeltaNet layers, gated attention every fourth) on UltraChat 200k
`train_sft`, one pass, 32,768-token packed blocks, loss on assistant tokens only, one 8xB300 node (workload.yaml).

Part I, the recipe, in the order it runs: settings (one dataclass; $HYPERPARAMETERS_PATH, --config FILE and
--key value override it) -> distributed setup -> data (this rank's shard, chat template, assistant-only loss mask,
whole conversations packed into blocks with the signals that keep them apart) -> model (meta device, activation
checkpointing, fully_shard per decoder layer, frozen tower, the root; each rank reads its slices of the checkpoint) ->
loss, optimizer and step (the token mean over all ranks) -> the loop -> run(), train(config), main().
Part II, operations: parsing, checks, counting, checkpoints, the recompute probe, metrics, eval, lock, SIGTERM, export.

  GPU node:   torchrun --nproc_per_node=8 train.py
  multi-node: torchrun --nnodes=$NUM_NODES --node_rank=$NODE_RANK --nproc_per_node=8 \\
                       --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT train.py --config job.yaml
  CPU smoke:  bash scripts/smoke.sh (tools/make_tiny_model.py .tiny-model, then examples/cpu_smoke.yaml on 2 ranks)
  the data only: python tools/inspect_data.py 2 [the same flags]; every setting: python train.py --help
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import difflib
import faulthandler
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import sys
import threading
import time
import weakref
import zlib
from collections import Counter, namedtuple
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import cache, partial
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


# ==== PART I: THE RECIPE ==========================================================================================
# ---- Settings ----------------------------------------------------------------------------------------------------
class UserError(ValueError): ...  # the user's to fix: main() prints one line and exits 2. Anything else is a bug


def setting(default, doc: str, resumable: bool = False):
    """A Config field; only a resumable one may change on resume (the data, schedule or optimizer don't need it)."""
    return dataclasses.field(default=default, metadata={"doc": doc, "resumable": resumable})


resumable = partial(setting, resumable=True)  # a setting that may change on resume


@dataclasses.dataclass(frozen=True)
class Config:  # every setting of a run, with the default job's values; checked on construction (check_settings)
    # Model. Revisions pin hub repos, so runs stay comparable ("" = latest).
    model_name: str = setting("Qwen/Qwen3.8-27B", "hub name or local directory")
    model_revision: str = setting("1d4bf0f2ff6012fd82039f2fa52739d0dd7c60c0", "hub revision (also the tokenizer's)")
    tokenizer_name: str = setting("", "tokenizer (and chat template) to use; empty: model_name's")
    trust_remote_code: bool = resumable(False, "run Python code a hub repo ships (repos you trust)")
    init: str = setting("pretrained", "pretrained weights, or random (benchmarks)")
    attn_implementation: str = resumable("auto", "attention kernel")
    master_dtype: str = setting("float32", "weights and AdamW state; bfloat16 halves them (the seed's)")
    param_dtype: str = resumable("bfloat16", "compute dtype of FSDP's all-gathered parameters")
    reduce_dtype: str = resumable("float32", "dtype gradients are reduce-scattered over ranks in")
    activation_checkpointing: str = resumable("auto", "share in [0, 1] of layers recomputed, or auto (measured)")
    compile: bool = resumable(True, "torch.compile the layers' norms and MLPs, and the loss (turn off for CPU runs)")
    float8: bool = resumable(False, "the decoder MLPs' matmuls in float8, rowwise scaled (torchao; Hopper or newer)")
    # Data: a hub dataset (streamed) or a local .jsonl / .json / .parquet file; or several, mixed (README, "Data").
    dataset_name: str = setting("HuggingFaceH4/ultrachat_200k", "hub dataset or local .jsonl/.json/.parquet file")
    dataset_revision: str = setting("8049631c405ae6576f93f445c6b8166f76f5505a", "hub dataset revision")
    dataset_split: str = setting("train_sft", "split of dataset_name to train on")
    datasets: tuple = setting((), "several sources instead, mixed by weight: [{name, split, revision, weight}, ...]")
    data_format: str = setting("auto", "records' form: auto (by their keys), messages, prompt_completion or text")
    messages_column: str = setting("messages", "column of the conversations (role/content, or ShareGPT's from/value)")
    tools_column: str = setting("tools", "column holding the tool definitions the chat template is given, if any")
    reasoning: str = setting("train", "assistant reasoning: trained with its answer, or dropped")
    eval_split: str = resumable("", "held-out split of dataset_name, or a local file; empty: none")
    eval_fraction: float = setting(0.0, "share in [0, 1] of the records held out (seeded), never trained, for eval")
    eval_blocks: int = resumable(8, "eval blocks per rank")
    max_seq_len: int = setting(32768, "tokens per packed block")
    pack_buffer_blocks: int = setting(64, "best-fit decreasing packs this many blocks' worth at a time")
    num_workers: int = setting(1, "DataLoader worker processes per rank (0: pack in the training process)")
    max_skip_fraction: float = resumable(0.2, "stop when more records than this share (in [0, 1]) are skipped")
    # Optimisation. One optimizer step = gradient_accumulation_steps blocks on every rank.
    learning_rate: float = setting(1e-5, "peak learning rate (> 0, finite)")
    adam_beta1: float = setting(0.9, "AdamW beta1, in [0, 1)")
    adam_beta2: float = setting(0.95, "AdamW beta2, in [0, 1)")
    weight_decay: float = setting(0.0, "AdamW weight decay (weight matrices, not the embedding)")
    max_grad_norm: float = resumable(1.0, "gradient clipping norm (> 0)")
    max_bad_steps: int = resumable(5, "stop after this many non-finite steps in a row")
    gradient_accumulation_steps: int = setting(1, "blocks per rank per optimizer step")
    epochs: int = setting(1, "passes over the data")
    max_steps: int = resumable(0, "> 0: the run's steps and its lr schedule's, no counting pass (data ends at epochs)")
    warmup_steps: int = setting(10, "linear warmup steps")
    lr_schedule: str = setting("cosine", "decay after warmup")
    min_lr_ratio: float = setting(0.1, "the decay ends at learning_rate * min_lr_ratio, in [0, 1]")
    loss_chunk_tokens: int = resumable(4096, "loss tokens per LM-head chunk")
    # Output: checkpoints/step_N (sharded, resumable), model/ (the consolidated Hugging Face export), metrics.jsonl
    output_dir: str = resumable("outputs/sft", "checkpoints, model/, metrics.jsonl; resumed from")
    save_every: int = resumable(100, "steps per checkpoint; 0: at the end; -1: never")
    save_every_minutes: float = resumable(0.0, "also save this long after the last save; 0: off")
    async_save: bool = resumable(True, "write checkpoints in the background (host memory holds a copy)")
    keep_checkpoints: int = resumable(2, "complete checkpoints kept")
    collective_timeout_s: float = resumable(300.0, "after the first step, a collective waiting this long ends the run")
    export: bool = resumable(True, "write output_dir/model, the Hugging Face checkpoint, at the end")
    log_every: int = resumable(10, "steps per log line (also logged at every checkpoint)")
    eval_every: int = resumable(0, "steps per eval; 0: only at the end (with eval data)")
    seed: int = setting(0, "blocks' order in each pack buffer, a mixture's draws, eval_fraction's records, init")

    def __post_init__(self):
        for f in dataclasses.fields(self):  # a default revision pins the default repo: another repo alone, its latest
            value, repo = typed(f, getattr(self, f.name), "Config"), f.name.replace("_revision", "_name")
            pins_another = repo != f.name and value == f.default and getattr(self, repo) != getattr(Config, repo)
            object.__setattr__(self, f.name, "" if pins_another else value)  # frozen: the only writes
        check_settings(self)


# ---- Distributed setup -------------------------------------------------------------------------------------------
STARTUP_TIMEOUT = timedelta(minutes=30)  # a collective's longest wait until training runs (collective_timeout_s then)
NCCL_ON_TIMEOUT = dict(TORCH_NCCL_ASYNC_ERROR_HANDLING="1", TORCH_FR_BUFFER_SIZE="2000", TORCH_NCCL_DUMP_ON_TIMEOUT="1")
Dist = namedtuple("Dist", "rank world_size device owns_group host_group save_group")  # owns_group: ours to end
STOP = threading.Event()  # set by SIGTERM while training (stop_on_sigterm), read by the loop before each step


def setup_distributed(output_dir: str = "outputs") -> Dist:  # joins torchrun's (or a notebook decorator's) group
    launched, env = "WORLD_SIZE" in os.environ, os.environ.get
    rank, local_rank, world_size = int(env("RANK", "0")), int(env("LOCAL_RANK", "0")), int(env("WORLD_SIZE", "1"))
    if not (env("PYTORCH_ALLOC_CONF") or env("PYTORCH_CUDA_ALLOC_CONF")):  # however launched; a user's own wins
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"  # docs/BENCHMARKS.md: stalls without
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        compile_autotuned_kernels_at_once()  # Triton's autotuner (fla's kernels): each configuration compiled first
    if owns_group := not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        how = {"store": attempt_store(world_size) if launched else dist.HashStore()}  # a world of one needs no port
        if backend == "nccl":  # a timed-out collective ends the rank (torchrun restarts it), its trace in output_dir
            how["device_id"], traces = device, {"TORCH_FR_DUMP_TEMP_FILE": f"{output_dir}/nccl_traces/rank_"}
            os.environ.update({k: v for k, v in (NCCL_ON_TIMEOUT | traces).items() if k not in os.environ})  # users win
            with contextlib.suppress(OSError):  # check_output_dir says it in one line
                Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"]).parent.mkdir(parents=True, exist_ok=True)
        dist.init_process_group(backend, timeout=STARTUP_TIMEOUT, rank=rank, world_size=world_size, **how)
    host_group = dist.new_group(backend="gloo")  # the host's numbers (counts, flags, the log's): no wait for the GPU
    save_group = dist.new_group(backend="gloo")  # checkpoints' (Checkpointer): a long timeout, not collective_timeout_s
    faulthandler.register(signal.SIGUSR1, sys.__stderr__, all_threads=True)  # kill -USR1 PID: stacks, workers' too
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun
        threading.Thread(target=exit_with_launcher, args=(os.getppid(),), name="launcher-watch", daemon=True).start()
    return Dist(rank, world_size, device, owns_group, host_group, save_group)


def attempt_store(world_size: int):  # torchrun's store (it outlives a restart) under this attempt's keys
    env = os.environ.get
    if env("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # rank 0 hosts a new one per attempt
    if int(env("TORCHELASTIC_MAX_RESTARTS", "0")) and world_size > int(env("LOCAL_WORLD_SIZE", world_size)):
        fix = "--rdzv-backend c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (as the workloads' torchrun)"
        raise UserError(f"torchrun --max-restarts over several nodes needs a new store per attempt: {fix}")
    store = dist.TCPStore(env("MASTER_ADDR"), int(env("MASTER_PORT")), world_size, False, timeout=STARTUP_TIMEOUT)
    return dist.PrefixStore(f"attempt_{env('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def print0(rank: int, *args, file=None) -> None:
    if rank == 0:
        print(*args, file=file, flush=True)


# ---- Data: read this rank's shard, render and mask each conversation, pack whole conversations into blocks -------
def data_sources(cfg: Config, part: str) -> list[dict]:  # of "train" or "eval", each labelled by what it reads
    one = {"name": cfg.dataset_name, "split": cfg.dataset_split, "revision": cfg.dataset_revision, "weight": 1}
    sources = [{"split": "train", "revision": "", "weight": 1, **source} for source in cfg.datasets] or [one]
    if part == "eval" and not cfg.eval_fraction:
        held_out = {"name": cfg.eval_split, "split": ""} if data_file(cfg.eval_split) else {"split": cfg.eval_split}
        sources = [{**one, **held_out}]
    for s in sources:  # a local file has no splits: any split name of it reads it all
        s["label"] = str(Path(s["name"]).resolve()) if data_file(s["name"]) else f"{s['name']} [{s['split']}]"
    return sources


def source_records(source: dict):  # (index, record) of a pass over it; a JSON line stays bytes until it is taken
    if (path := Path(source["name"])).suffix == ".jsonl":
        with open(path, "rb") as f:
            yield from ((index, line) for index, line in enumerate(f) if line.strip())  # blank lines are no records
        return
    from datasets import load_dataset  # imported here: a .jsonl file does not need it

    file = {"path": path.suffix[1:], "data_files": str(path), "split": "train"}  # .json or .parquet, by its builder
    hub = {"path": source["name"], "split": source["split"], "revision": source["revision"] or None}
    rows = load_dataset(**(file if path.suffix in (".json", ".parquet") else hub), streaming=True).iter(batch_size=1)
    yield from enumerate({k: v[0] for k, v in row.items()} for row in rows)  # .iter(): each data worker reads all


def decoded(record):  # a record, a JSON line's decoded; None for a line that is not UTF-8 JSON
    with contextlib.suppress(UnicodeDecodeError, json.JSONDecodeError):
        return json.loads(record.decode("utf-8-sig")) if isinstance(record, bytes) else record  # -sig: a BOM


def read_records(cfg: Config, part: str, shard: int, num_shards: int, start: int, skips, epoch=0, report=False):
    """(index, record, source) of shard index % num_shards from start on: sources drawn by weight (README, "Data")."""
    sources = data_sources(cfg, part)
    passes, ended, index = [source_records(source) for source in sources], set(), -1
    draw, weights = random.Random(f"{cfg.seed}/{epoch}"), [source["weight"] for source in sources]
    while len(ended) < len(sources):
        s = draw.choices(range(len(sources)), weights)[0] if len(sources) > 1 else 0
        if (item := next(passes[s], None)) is None:  # its pass is over: the next begins
            ended.add(s)
            passes[s] = source_records(sources[s])
            continue
        index, (i, record) = index + 1, item
        if index < start or index % num_shards != shard:
            continue
        place = f"{cfg.seed}/{i}"  # held out in every pass or in none, and in each source that holds the same records
        if cfg.eval_fraction and (zlib.crc32(place.encode()) < cfg.eval_fraction * 2**32) != (part == "eval"):
            continue
        if (record := decoded(record)) is None:
            skips.update({"unreadable line": 1, (s, "unreadable line"): 1})  # in all, and by source
            if report and s not in ended and skips["unreadable line"] <= 3:  # the first few, in a first pass
                print(f"warning: {sources[s]['name']} line {i + 1} is not UTF-8 JSON: skipped", flush=True)
            continue
        yield index, record, s


class Skip(Exception): ...  # a record that cannot be trained on; its message, the reason, is counted


def record_form(record, cfg: Config) -> str:  # data_format, or with auto the first form the keys fit
    keys = {k for k, v in record.items() if v is not None} if isinstance(record, dict) else set()  # Parquet's nulls
    fits = {"messages": bool({cfg.messages_column, "conversations"} & keys)}
    fits |= {"prompt_completion": {"prompt", "completion"} <= keys, "text": "text" in keys}
    form = cfg.data_format if cfg.data_format != "auto" else next((f for f, fit in fits.items() if fit), None)
    if form is None or not fits[form]:
        raise Skip(f"no column of the form {form}" if form else "no column of a known form")
    return form


def samples_of(record: dict, masker: AssistantMasker, cfg: Config) -> list[tuple[list[int], list[bool]]]:
    """A record's samples by its form (README, "Data forms"): assistant turns (a completion's only), or plain text."""
    form, prompt, completion = record_form(record, cfg), record.get("prompt"), record.get("completion")
    if form == "text" or form == "prompt_completion" and isinstance(prompt, str) and isinstance(completion, str):
        return [masker.plain("", record["text"]) if form == "text" else masker.plain(prompt, completion)]
    if form == "prompt_completion" and not (isinstance(prompt, list) and isinstance(completion, list)):
        raise Skip("prompt and completion neither strings nor message lists")
    column = cfg.messages_column if record.get(cfg.messages_column) is not None else "conversations"  # Parquet's nulls
    messages, trained_from = (prompt + completion, len(prompt)) if form == "prompt_completion" else (record[column], 0)
    messages, tools = conversation_of(messages, record.get(cfg.tools_column), cfg)  # a prompt's turns carry no loss
    if not any(m["role"] == "assistant" for m in messages[trained_from:]):
        raise Skip("no assistant turn" + (" in the completion" if trained_from else ""))
    return masker.samples(messages, tools, trained_from)


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "observation": "tool", "function_call": "assistant"}
data_file = re.compile(r".+\.(jsonl|json|parquet)").fullmatch  # a local data file, by its suffix; other names: hub's
EXTRA_SAMPLES = "extra samples for earlier reasoning turns"  # a count beside conversations, not a skip reason


def conversation_of(messages, tools, cfg: Config) -> tuple[list, list | None]:
    """As templates take them (ShareGPT's mapped, text parts joined, JSON arguments parsed), checked, or Skip."""
    if not isinstance(messages, list) or not messages:
        raise Skip("messages not a non-empty list")
    try:
        tools, joined = json.loads(tools or "null") if isinstance(tools, str) else tools, []  # "": none
        for m in messages:
            if isinstance(m, dict) and "from" in m and "value" in m and m.get("role") is None:  # ShareGPT's form
                said, value = m["from"], m["value"]
                m = {"role": SHAREGPT_ROLES.get(str(said), said), "content": value}  # a list: "unknown role"
                if said == "function_call":  # as the tool call it is
                    call = json.loads(value) if isinstance(value, str) else value
                    m = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
                raise Skip("unknown role")
            if isinstance(parts := m.get("content"), list):
                texts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in parts]
                if not all(isinstance(text, str) for text in texts):
                    raise Skip("a content part that is not text")
                m = {**m, "content": "".join(texts)}
            if isinstance(m.get("tool_calls"), list):
                m = {**m, "tool_calls": [parsed_arguments(call) for call in m["tool_calls"]]}
                m["content"] = "" if m.get("content") is None else m["content"]  # OpenAI's form: null
            if cfg.reasoning == "drop" and m["role"] == "assistant":
                m = {k: v for k, v in m.items() if k != "reasoning_content"}
                if isinstance(m.get("content"), str) and "</think>" in m["content"]:
                    m["content"] = m["content"].partition("</think>")[2].lstrip("\n")
            if not isinstance(m.get("content"), str) or not (m["content"].strip() or m.get("tool_calls")):
                if m["role"] not in ("system", "tool") or not isinstance(m.get("content"), str):  # these may be empty
                    raise Skip("empty or non-string content")  # a tool-call turn may have no text
            if not isinstance(m.get("reasoning_content") or "", str):
                raise Skip("non-string reasoning_content")
            joined.append(m)
    except json.JSONDecodeError:
        raise Skip("tools or tool-call arguments not JSON") from None
    return joined, tools


def parsed_arguments(call):  # its arguments as a mapping; a struct's without None (Parquet gives it every key)
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = json.loads(given or "{}") if isinstance(given := function.get("arguments"), str) else given  # "": none
    arguments = {k: v for k, v in arguments.items() if v is not None} if isinstance(given, dict) else arguments
    function = {**function, "arguments": arguments}
    return {**call, "function": function} if "function" in call else function


class AssistantMasker:
    """Tokenizes a conversation with its chat template and masks all but its assistant turns (README, "Loss mask"):
    rendered as is and with placeholders, the first must be the second with the texts put back, else it is skipped."""

    def __init__(self, tokenizer):
        self.tok, self.renders_reasoning = tokenizer, "reasoning_content" in (tokenizer.chat_template or "")
        self.special = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len)

    def samples(self, messages: list[dict], tools=None, trained_from: int = 0) -> list[tuple[list[int], list[bool]]]:
        """[(ids, mask), ...]: the conversation, and each turn whose reasoning it drops (README); a prompt untrained."""
        messages, prompt = [self.reasoning_apart(m) for m in messages], set(range(trained_from))
        ids, mask, dropped = self.render(messages, tools, skip=prompt)
        if not (dropped := dropped - prompt):
            return [(ids, mask)]
        samples = [self.render(messages, tools, skip=dropped | prompt)[:2]]  # the whole conversation without those
        for i in sorted(dropped):  # then each of them with its past
            ids, mask, still = self.render(messages[: i + 1], tools, skip=set(range(i)))
            if i in still:
                raise Skip("template drops the reasoning of a last turn")
            samples.append((ids, mask))
        return samples

    def __call__(self, messages: list[dict], tools: list | None = None) -> tuple[list[int], list[bool]]:
        return self.render([self.reasoning_apart(m) for m in messages], tools)[:2]  # the whole conversation, once

    def plain(self, prompt: str, completion: str) -> tuple[list[int], list[bool]]:
        """No template, as TRL: the prompt as for generation; the completion (tokenized apart) and EOS take the loss."""
        if not isinstance(completion, str) or not completion.strip():
            raise Skip("empty or non-string text or completion")
        eos = [self.tok.eos_token_id] if self.tok.eos_token_id is not None else []
        prompt_ids = self.tok(prompt)["input_ids"]
        completion_ids = self.tok(completion, add_special_tokens=False)["input_ids"] + eos
        return prompt_ids + completion_ids, [False] * len(prompt_ids) + [True] * len(completion_ids)

    def reasoning_apart(self, m: dict) -> dict:
        content = m["content"]  # a leading `<think>...</think>` as reasoning_content, for templates that render it
        if not self.renders_reasoning or m["role"] != "assistant" or "</think>" not in content:
            return m
        reasoning, _, answer = content.partition("</think>")
        return {**m, "reasoning_content": reasoning.split("<think>")[-1].strip("\n"), "content": answer.lstrip("\n")}

    def render(self, messages: list[dict], tools, skip=()) -> tuple[list[int], list[bool], set]:
        """(ids, mask over the assistant turns not in skip, the turns whose reasoning the template left out)."""
        dumps = partial(json.dumps, default=str)
        texts = [m["content"] + (m.get("reasoning_content") or "") + dumps(m.get("tool_calls")) for m in messages]
        if any(s in t for t in texts + [dumps(tools)] for s in self.special):
            raise Skip("special-token text in a content")  # it would be tokenized as real turn markers
        if not self.renders_reasoning and any(m.get("reasoning_content") for m in messages):
            raise Skip("reasoning the template does not render (set reasoning: drop)")
        slots = []  # (message index, placeholder, its text) in the order a template renders them
        skeleton_messages = [dict(m) for m in messages]  # the messages with the placeholders in place of their texts
        for i, m in enumerate(messages):
            if self.renders_reasoning and m["role"] == "assistant" and (m.get("reasoning_content") or "").strip():
                slots.append((i, f"\ue000r{i}\ue001", m["reasoning_content"]))
                skeleton_messages[i]["reasoning_content"] = slots[-1][1]
            if m["content"]:  # a tool-call-only turn's empty content gets no placeholder:
                slots.append((i, f"\ue000c{i}\ue001", m["content"]))  # templates render calls differently after one
                skeleton_messages[i]["content"] = slots[-1][1]
        if not self.tok.chat_template:
            raise Skip("a conversation, and the tokenizer has no chat_template (set tokenizer_name to one that has)")
        render = partial(self.tok.apply_chat_template, tools=tools, tokenize=False)
        try:  # templates raise on conversations they refuse (e.g. Qwen3.5: no user turn)
            text, skeleton = render(messages), render(skeleton_messages)
            empty = [i for i, m in enumerate(messages) if not m["content"] and m.get("tool_calls") and i not in skip]
            call_only = {i: self.call_only_turn(render, messages, i, text) for i in empty}
        except Exception as e:  # jinja2's TemplateError, or whatever the template's own raise_exception gives
            raise Skip(f"chat template error: {str(e)[:80]}") from None
        dropped = {i for i, holder, _ in slots if holder[1] == "r" and holder not in skeleton}
        if None in call_only.values():
            raise Skip("template renders content-dependently")
        spans, pos, rest, reasoning_at = [], 0, skeleton, {}
        for i, holder, value in [slot for slot in slots if slot[0] not in dropped or slot[1][1] == "c"]:
            before, found, rest = rest.partition(holder)
            if not found or not text.startswith(before, pos):
                raise Skip("template renders content-dependently")
            pos, after = pos + len(before), rest.split("\ue000", 1)[0]  # skeleton text up to the next placeholder
            value = next((v for v in (value, value.strip()) if text.startswith(v + after, pos)), None)
            if value is None:  # neither as given nor stripped (as many templates trim)
                raise Skip("template renders content-dependently")
            if holder[1] == "r":
                reasoning_at[i] = pos  # the span of a turn with rendered reasoning starts with it
            elif messages[i]["role"] == "assistant" and i not in skip:
                if (end := self.end_of_turn(after)) is None:
                    raise Skip("no end-of-turn token after an assistant turn")
                spans.append((reasoning_at.get(i, pos), pos + len(value) + end))
            pos += len(value)
        if text[pos:] != rest:
            raise Skip("template renders content-dependently")
        spans += [(reasoning_at.get(i, start), end) for i, (start, end) in call_only.items()]
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)  # spans: character ranges
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        starts, ends = {start for start, _ in offsets}, {end for _, end in offsets}
        if any(a not in starts or b not in ends for a, b in spans):
            raise Skip("assistant span not on token boundaries")
        return ids, [any(a <= start and end <= b for a, b in spans) for start, end in offsets], dropped

    def end_of_turn(self, text: str, start: int = 0) -> int | None:
        """Where the first special token at or after start ends (the longest one there), or None."""
        first = min((k for k in (text.find(s, start) for s in self.special) if k >= 0), default=-1)
        return None if first < 0 else first + max(len(s) for s in self.special if text.startswith(s, first))

    def call_only_turn(self, render, messages: list[dict], i: int, text: str) -> tuple[int, int] | None:
        """The span of a turn that only calls tools, from where a content would start; None if rendered otherwise."""
        variant = render([{**m, "content": "\ue000"} if j == i else m for j, m in enumerate(messages)])
        start, m = variant.find("\ue000"), messages[i]
        start = len(prefix := variant[:start] if start >= 0 else render(messages[:i], add_generation_prompt=True))
        end = self.end_of_turn(text, start) if text.startswith(prefix) else None
        names = [(c.get("function") or c).get("name", "") for c in m.get("tool_calls") or [] if isinstance(c, dict)]
        if m["role"] != "assistant" or end is None or not all(str(n) in text[start:end] for n in names):
            return None
        return start, end


def tokenize_stream(records, masker: AssistantMasker, cfg: Config, counts: Counter):
    """(index, samples) per trainable record; counts skips by reason, truncations, extra samples (also by source)."""
    for index, record, source in records:
        try:
            result = samples_of(record, masker, cfg)
            samples = [(ids[: cfg.max_seq_len], mask[: cfg.max_seq_len]) for ids, mask in result]
            if any(len(ids) > cfg.max_seq_len for ids, _ in result):
                counts.update({"truncated": 1, (source, "truncated"): 1})
            if not (samples := [(ids, mask) for ids, mask in samples if any(mask[1:])]):  # no trained turn left:
                raise Skip("no loss tokens after truncation")  # or each trained in a sample of its own (reasoning)
        except Skip as reason:
            counts.update({str(reason): 1, (source, str(reason)): 1})
            continue
        counts.update({"conversations": 1, (source, "conversations"): 1})
        if len(samples) > 1:
            counts.update({EXTRA_SAMPLES: len(samples) - 1, (source, EXTRA_SAMPLES): len(samples) - 1})
        counts[source, "tokens"] += sum(len(ids) for ids, _ in samples)
        counts[source, "loss tokens"] += sum(sum(mask[1:]) for _, mask in samples)
        yield index, samples


def skip_reasons(counts: dict) -> dict:
    kept = ("conversations", "truncated", EXTRA_SAMPLES)
    return {k: v for k, v in counts.items() if isinstance(k, str) and k not in kept}  # over all sources


def by_source(counts: dict, cfg: Config) -> dict:  # {source: {what: count}} when there are several sources
    sources, out = data_sources(cfg, "train"), {}
    for (s, what), n in sorted((k, v) for k, v in counts.items() if isinstance(k, tuple) and len(sources) > 1):
        rev = sources[s]["revision"]  # a split at two revisions: two sources
        out.setdefault(sources[s]["label"] + (f" @{rev}" if rev else ""), {})[what] = n
    return out


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices, lengths summing to <= capacity: longest first, each into the fullest bin it fits."""
    bins, room = [], []  # each bin's items, and the room left in it
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = min((b for b in range(len(bins)) if room[b] >= lengths[i]), key=lambda b: room[b], default=len(bins))
        bins, room = (bins, room) if b < len(bins) else ([*bins, []], [*room, capacity])  # none had room: a new bin
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


def make_block(segments: list[tuple[list[int], list[bool]]], block_len: int, pad_id: int) -> dict:
    """One packed block of whole conversations with the signals that keep them apart. Segments of 3 and 2 tokens in 7
    (the padding is a segment of its own):
      position_ids [0 1 2 0 1 0 1]   cu_seqlens [0 3 5 7]   seq_idx [0 0 0 1 1 2 2]   max_length 3
    labels: the masked-in tokens, else -100, also on each segment's first token (its target is the previous one's)."""
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


def filler_block(pad_id: int) -> dict:  # what a rank whose data ran out feeds FSDP's collectives: loss, gradient 0
    return {**make_block([([pad_id] * 16, [False] * 16)], 16, pad_id), "tokens": 0, "sum_sq_len": 0}


def pad_token_id(tokenizer) -> int:  # padding carries no loss, so any id will do; Llama's has none: end-of-sequence
    return next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)  # or neither


@dataclasses.dataclass
class StreamPosition:  # where a block sits in its stream: a resume packs its buffer again, skipping the blocks taken
    slot: int  # the DataLoader worker slot that reads this stream
    epoch: int
    record: int  # index of the buffer's first record in the stream
    buffer: int  # buffers before this one in the epoch: it seeds the order of the buffer's blocks
    counts_at_start: dict
    counts_at_end: dict
    taken: int = 0  # blocks taken from the buffer, this one included
    carried: tuple = ()  # (record, sample) of the samples it began with: the last buffer's emptiest block


class PackedBlocks(IterableDataset):  # `epochs` passes over this rank's shard (slot s of rank r reads r * workers + s)
    def __init__(self, cfg: Config, tokenizer, part: str, rank, world_size, epochs, resume=None, report=True):
        self.cfg, self.tok, self.part, self.report = cfg, tokenizer, part, report  # report: read_records'
        self.rank, self.world_size, self.epochs = rank, world_size, epochs
        self.streams, self.next_slot = (dict(resume.streams), resume.next_slot) if resume else ({}, 0)  # a Progress's

    def __iter__(self):
        cfg, worker = self.cfg, get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker else (0, 1)
        slot = (worker_id + self.next_slot) % num_workers
        shard, num_shards = self.rank * num_workers + slot, self.world_size * num_workers
        at = self.streams.get(slot, StreamPosition(slot, 0, 0, 0, {}, {}))
        masker, pad_id, counts = AssistantMasker(self.tok), pad_token_id(self.tok), Counter(at.counts_at_start)
        for epoch in range(at.epoch, self.epochs):
            first, n_buffer, skip = (at.record, at.buffer, at.taken) if epoch == at.epoch else (0, 0, 0)
            carried = tuple(at.carried) if epoch == at.epoch else ()
            tally = counts if epoch == 0 else Counter()  # of the data, not the passes: later epochs re-read the records
            records = read_records(cfg, self.part, shard, num_shards, first, tally, epoch, self.report and epoch == 0)
            buffer, names = self.read_again(carried, masker, shard, num_shards, epoch), list(carried)
            buffered, start_counts = sum(len(ids) for ids, _ in buffer), dict(counts)
            for index, samples in tokenize_stream(records, masker, cfg, tally):  # a record's samples share a buffer
                buffer += samples
                names += [(index, k) for k in range(len(samples))]
                buffered += sum(len(ids) for ids, _ in samples)
                if buffered >= cfg.pack_buffer_blocks * cfg.max_seq_len:
                    where = StreamPosition(slot, epoch, first, n_buffer, start_counts, dict(counts), carried=carried)
                    waiting = yield from self._pack(buffer, pad_id, shard, where, skip, carry=True)
                    buffer, names = [buffer[i] for i in waiting], [names[i] for i in waiting]
                    buffered, carried = sum(len(ids) for ids, _ in buffer), tuple(names)
                    first, n_buffer, skip, start_counts = index + 1, n_buffer + 1, 0, dict(counts)
            where = StreamPosition(slot, epoch, first, n_buffer, start_counts, dict(counts), carried=carried)
            yield from self._pack(buffer, pad_id, shard, where, skip, carry=False)  # an epoch ends with its buffer
        # The stream's end, a blockless item with its final counts (they reach the totals from a rank without blocks)
        yield {"position": StreamPosition(slot, self.epochs, 0, 0, dict(counts), dict(counts))}

    def _pack(self, buffer, pad_id: int, shard: int, where: StreamPosition, skip: int, carry: bool):
        """Yields the blocks in a seeded order; the emptiest ends the epoch, or (carry) returns for the next buffer."""
        bins = best_fit_decreasing([len(ids) for ids, _ in buffer], self.cfg.max_seq_len)
        emptiest = min(bins, key=lambda b: sum(len(buffer[i][0]) for i in b), default=[])
        bins = [b for b in bins if b is not emptiest]
        random.Random(str((self.cfg.seed, shard, where.epoch, where.buffer))).shuffle(bins)
        if emptiest and not carry:
            bins.append(emptiest)
        for n, members in enumerate(bins[skip:], skip + 1):
            block = make_block([buffer[i] for i in members], self.cfg.max_seq_len, pad_id)
            yield {**block, "position": dataclasses.replace(where, taken=n)}
        return sorted(emptiest) if carry else []

    def read_again(self, carried: tuple, masker, shard: int, num_shards: int, epoch: int) -> list:
        """A resumed buffer's carried samples, from their records (before its first one); their counts were taken."""
        wanted, found = {record for record, _ in carried}, {}
        if not wanted:
            return []
        records = read_records(self.cfg, self.part, shard, num_shards, min(wanted), Counter(), epoch)
        for index, samples in tokenize_stream((r for r in records if r[0] in wanted), masker, self.cfg, Counter()):
            found[index] = samples
            if len(found) == len(wanted):
                break
        if lost := sorted(wanted - found.keys()):  # the data changed since the checkpoint was written
            names = ", ".join(source["label"] for source in data_sources(self.cfg, self.part))
            raise UserError(f"{names}: records {lost[:5]}, carried into the resumed buffer, no longer train")
        return [found[record][k] for record, k in carried]


def block_loader(cfg: Config, tokenizer, part, rank, world_size, epochs, resume=None, report=True, counting=False):
    data = (CountedBlocks if counting else PackedBlocks)(cfg, tokenizer, part, rank, world_size, epochs, resume, report)
    # Workers pack while the GPU trains, each its own shard; the DataLoader takes from them in turn.
    extra = {"prefetch_factor": 4, "worker_init_fn": partial(start_data_worker, os.getpid())}
    pinned, workers = torch.cuda.is_available() and not counting, cfg.num_workers  # counting: no tensors, no pinning
    return DataLoader(data, batch_size=None, num_workers=workers, pin_memory=pinned, **(extra if workers else {}))


def load_tokenizer(cfg: Config):
    from transformers import AutoTokenizer  # here and below imported where used: it reads HF_HOME and HF_HUB_OFFLINE

    name = cfg.tokenizer_name or cfg.model_name
    revision = (cfg.model_revision or None) if not cfg.tokenizer_name and not Path(name).exists() else None
    load = partial(AutoTokenizer.from_pretrained, name, revision=revision, trust_remote_code=cfg.trust_remote_code)
    return from_hub(load, name)


# ---- Model: build, activation checkpointing, FSDP2, load ---------------------------------------------------------
def torch_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention over PyTorch's varlen flash kernel: [1, H, T, D] in, [1, T, H, D] out."""
    from torch.nn.attention.varlen import varlen_attn

    unsupported = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
    if dropout or unsupported:
        raise NotImplementedError(f"torch_varlen does not do {unsupported or 'dropout'}: use flash_attention_2")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if k.shape[1] != q.shape[1]:  # GQA: torch 2.11's varlen_attn has no enable_gqa
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]  # window_size (-1, 0): causal
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=(-1, 0)).unsqueeze(0), None


def model_config(name: str | Path, revision: str = "", trust_remote_code: bool = False):
    from transformers import AutoConfig

    revision = None if Path(name).exists() else revision or None
    load = partial(AutoConfig.from_pretrained, name, revision=revision, trust_remote_code=trust_remote_code)
    config = from_hub(load, str(name))
    config.use_cache = config.get_text_config().use_cache = False  # with a cache, transformers derives no
    return config  # block-diagonal mask from position_ids: packed conversations would mix


def recompute_share(value: str) -> float | None:
    return None if value == "auto" else float(value)  # activation_checkpointing as the share of layers recomputed


def build_model(config, cfg: Config, attn: str, device: torch.device):
    """The model on meta, activation checkpointing, fully_shard per layer, frozen tower, the root; shards allocated."""
    import transformers

    image_text = type(config) in transformers.AutoModelForImageTextToText._model_mapping
    model_class = transformers.AutoModelForImageTextToText if image_text else transformers.AutoModelForCausalLM
    dtype, remote_code = getattr(torch, cfg.master_dtype), cfg.trust_remote_code
    with torch.device("meta"):
        model = model_class.from_config(config, attn_implementation=attn, dtype=dtype, trust_remote_code=remote_code)
    model.requires_grad_(False).get_decoder().requires_grad_(True)  # only the decoder and LM head train; a VLM's
    head = model.get_output_embeddings().requires_grad_(True)  # vision tower is frozen (exported): no grad, no state
    transforms = "final_logit_softcapping logits_soft_cap output_logit_soft_cap logit_scale logits_scaling".split()
    transforms += "lm_head_multiplier output_multiplier logits_mup_width_multiplier".split()  # by model, keys differ
    scaled = {k: v for k in transforms if (v := getattr(config.get_text_config(), k, None)) not in (None, 1)}
    if scaled or getattr(head, "bias", None) is not None:  # the model's loss would not be the one trained
        raise UserError(f"the model's LM head has {scaled or 'a bias'}: HeadLoss (the fused head and loss) has none")
    layers, share = model.get_decoder().layers, recompute_share(cfg.activation_checkpointing)
    if share is None or share > 0:  # auto: all at first (RecomputeProbe keeps some); transformers' wraps in FSDP hooks
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        n, k = len(layers), round((1.0 if share is None else share) * len(layers))  # k: the layers recomputed
        for i, layer in enumerate(layers):  # a share f recomputes an evenly spread f of the layers
            layer.gradient_checkpointing = (i + 1) * k // n > i * k // n
    if cfg.float8:  # the MLPs only: ~70% of the matmul FLOPs, compiled (the casts fuse); weights keep dtype and names
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        for module in (m for layer in layers for m in layer.modules() if type(m).__name__.endswith("MLP")):
            convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name("rowwise"))
    if cfg.compile:
        compile_elementwise(layers)
        model.compiled_softmax_gradient = torch.compile(softmax_gradient, dynamic=True)  # chunks of any length
    mesh = dist.init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(getattr(torch, cfg.param_dtype), getattr(torch, cfg.reduce_dtype))  # param, reduce
    towers = [m for m in model.model.children() if {p.requires_grad for p in m.parameters()} == {False}]  # frozen
    for module in [*layers, *towers, model]:  # each decoder layer, each frozen tower (never called: never gathered;
        fully_shard(module, mesh=mesh, mp_policy=policy)  # in the root's unit, every step's forward would), the root
        if mesh.size() == 1:  # FSDP's reduce on one rank copies the gradients: OneRankReduce makes it no copy
            module.set_custom_reduce_scatter(OneRankReduce())
    model.to_empty(device=device)
    for module in (m for m in model.modules() if m._buffers):  # buffers (rotary inv_freq) are in no checkpoint:
        model._init_weights(module)  # the model's initialiser computes them, as transformers does
    model.token_losses = token_losses.__get__(model)  # token_losses skips model.forward: registered,
    register_fsdp_forward_method(model, "token_losses")  # FSDP all-gathers the root's parameters around it too
    return model


class OneRankReduce:  # FSDP's reduce-scatter on one rank, where FSDP copies its input (all gradients: 22 GB a step in
    def allocate(self, size, *, dtype, device) -> torch.Tensor:  # the 8-layer geometry) into an output it asks for.
        held = None if "reduce_output" in (caller := sys._getframe(1).f_locals) else caller.get("reduce_scatter_input")
        if held is None or held.shape != torch.Size(size) or held.dtype != dtype:  # Asked by FSDP's foreach_reduce with
            return torch.empty(size, dtype=dtype, device=device)  # its input bound and its output not, this returns
        if held.is_cuda:  # that input (copy_ skips a copy onto itself), which FSDP may cast or add to the gradients on
            held.record_stream(torch.cuda.current_stream())  # its own stream after letting it go
        return held


def compile_elementwise(layers) -> None:  # norms and MLPs (docs/BENCHMARKS.md); fla's and conv1d's kernels stay eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    kinds = ("RMSNorm", "RMSNormGated", "MLP")
    for module in (m for layer in layers for m in layer.modules() if type(m).__name__.endswith(kinds)):
        module.compile(dynamic=False)


@cache  # once a process: Triton's autotuner compiles each configuration as it times it, one after another (fla's 118
def compile_autotuned_kernels_at_once() -> None:  # for Qwen3.5 took step 1 130-156 s on an empty cache): threads first
    from triton.runtime._async_compile import AsyncCompileMode  # Triton >= 3.6 (ignore_errors)
    from triton.runtime.autotuner import Autotuner

    threads = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the node's CPUs, shared
    prune, pool = Autotuner.prune_configs, ThreadPoolExecutor(max(1, threads))

    def prune_and_compile(tuner, kwargs: dict) -> list:  # run() calls it for a key it has not timed, with its args
        configs = prune(tuner, kwargs)
        with AsyncCompileMode(pool, ignore_errors=True):  # one that fails fails again when timed: it times inf
            for config in configs if len(configs) > 1 else []:  # one config: Triton runs it untimed
                tuner.fn.run(**tuner.nargs, **kwargs | config.all_kwargs() | {"warmup": True})  # compiled, not run
        return configs

    Autotuner.prune_configs = prune_and_compile


def load_pretrained(model, path: Path, source_dtypes: dict) -> None:
    """Each rank reads only its own slices of the safetensors files: no rank holds the whole model."""
    state, tied_head = model.state_dict(), "lm_head.weight" if model.config.tie_word_embeddings else None
    if missing := [k for k in state if k not in source_dtypes and k != tied_head]:
        raise UserError(f"{len(missing)} model tensors are not in the checkpoint at {path}, e.g. {missing[:3]}")
    dcp.load({k: v for k, v in state.items() if k in source_dtypes}, storage_reader=HuggingFaceStorageReader(str(path)))


# ---- Loss: the LM head and cross-entropy on the loss positions only, in chunks -----------------------------------
def packed_inputs(block: dict) -> dict:  # the token ids and the signals that keep the block's conversations apart
    return {
        "input_ids": block["input_ids"],
        "position_ids": block["position_ids"],  # full attention: rotary positions, and sdpa's block mask
        "cu_seq_lens_q": block["cu_seqlens"],  # varlen attention and the gated delta rule
        "cu_seq_lens_k": block["cu_seqlens"],
        "max_length_q": block["max_length"],
        "max_length_k": block["max_length"],
        "seq_idx": block["seq_idx"],  # causal-conv1d
        "use_cache": False,  # a cache would also stop sdpa's block mask from being derived
    }


def token_losses(model, block: dict, chunk_tokens: int = 4096, loss_weight: float = 1.0) -> torch.Tensor:
    """Per-token cross-entropy (fp32) at the loss positions, the LM head on those only, in chunks (HeadLoss)."""
    hidden, head = model.model(**packed_inputs(block)).last_hidden_state[0], model.get_output_embeddings()
    targets = block["labels"][0, 1:]  # a block without loss tokens still runs HeadLoss, keeping FSDP's backward
    where = (targets != -100).nonzero().squeeze(1)  # hooks connected: an exact 0 loss
    loss_fn = getattr(model, "compiled_softmax_gradient", softmax_gradient)  # build_model's, with compile
    weight = loss_weight if torch.is_grad_enabled() else None  # None: no gradients (evaluation)
    return HeadLoss.apply(hidden[where], head.weight, targets[where], chunk_tokens, weight, loss_fn)


def softmax_gradient(logits: torch.Tensor, targets: torch.Tensor):  # rows' cross-entropy and its d / d logits
    x, hit = logits.float(), torch.arange(logits.shape[1], device=logits.device) == targets[:, None]
    lse = x.logsumexp(dim=1)  # compiled (build_model, GPUs): two passes over the logits, no fp32 copy of them
    softmax = (x - lse[:, None]).exp()
    return lse - x.gather(1, targets[:, None]).squeeze(1), torch.where(hit, softmax - 1, softmax).to(logits.dtype)


class HeadLoss(torch.autograd.Function):  # LM head and cross-entropy, their gradients in the forward: no logits kept
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens: int, loss_weight: float | None, loss_fn):
        ctx.loss_weight, losses = loss_weight, torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
        grad_hidden, grad_weight = (torch.zeros_like(hidden), torch.zeros_like(weight)) if loss_weight else (None, None)
        for start in range(0, len(targets), chunk_tokens):  # each gradient times loss_weight in its GEMM (alpha):
            rows = slice(start, start + chunk_tokens)  # no pass over the head's gradient to scale it afterwards
            losses[rows], grad_logits = loss_fn(hidden[rows] @ weight.T, targets[rows])  # 2 GB at 4,096 x 248k vocab
            if loss_weight:  # None (evaluation) or 0: no gradients
                grad_hidden[rows].addmm_(grad_logits, weight, alpha=loss_weight)
                grad_weight.addmm_(grad_logits.T, hidden[rows], alpha=loss_weight)
            del grad_logits  # before the next chunk allocates its own: the peak holds one chunk's tensors, not two
        ctx.save_for_backward(grad_hidden, grad_weight)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):  # the forward's gradients, if each loss weighs loss_weight (float32, as autograd's)
        torch._assert_async((grad_losses == ctx.loss_weight).all(), "HeadLoss: a token's loss weighs not loss_weight")
        return *ctx.saved_tensors, *[None] * 4


# ---- Optimizer and schedule --------------------------------------------------------------------------------------
def lr_factor(step: int, cfg: Config, total_steps: int) -> float:  # warmup, then cosine or linear decay to min_lr_ratio
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    shape = {"cosine": 0.5 * (1 + math.cos(math.pi * progress)), "linear": 1 - progress, "constant": 1}[cfg.lr_schedule]
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def make_optimizer(model, cfg: Config, total_steps: int):  # AdamW with warmup and decay
    trained, embedding = [p for p in model.parameters() if p.requires_grad], model.get_input_embeddings().weight
    decay = [p for p in trained if p.ndim >= 2 and p is not embedding]
    no_decay = [p for p in trained if p.ndim < 2 or p is embedding]  # norms, biases, A_log, dt_bias, embeddings
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    betas = (cfg.adam_beta1, cfg.adam_beta2)  # fused (CPUs too): one kernel, and it takes train_step's clipping
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas, weight_decay=cfg.weight_decay, fused=True)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))


# ---- One step, the loop, the entry points ------------------------------------------------------------------------
@dataclasses.dataclass
class Progress:  # this rank's resumable state, saved with every checkpoint: the step, where each data stream is
    step: int = 0
    streams: dict = dataclasses.field(default_factory=dict)  # slot -> StreamPosition of its last block taken
    next_slot: int = 0
    blocks: int = 0  # blocks this rank has trained on
    bad_steps: int = 0  # steps skipped for a non-finite loss or gradient norm
    bad_in_a_row: int = 0

    def blocks_of(self, items, num_workers: int):  # each item recorded as taken (a stream's end, without a block, too)
        for item in items:
            self.streams[item["position"].slot] = item["position"]
            self.next_slot = (item["position"].slot + 1) % max(1, num_workers)
            if "input_ids" in item:
                self.blocks += 1
                yield item

    def stream_counts(self) -> Counter:
        return sum((Counter(p.counts_at_end) for p in self.streams.values()), Counter())


@dataclasses.dataclass
class Job:  # what a step, the loop and the operations work on
    cfg: Config
    d: Dist
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total_steps: int
    progress: Progress
    filler: dict  # the block of a rank whose data has run out
    step_hook: object = None  # f(step, model, loss_sum, blocks) -> a new loss_sum or None, after each backward
    host_moments: HostMoments | None = None  # AdamW's moments off the GPU but in its step: auto's call at long blocks


@dataclasses.dataclass
class StepStats:  # a step's counts over all ranks, and its results
    max_blocks: int  # the most blocks a rank had: 0 when every rank's data has run out
    blocks: int
    loss_tokens: int
    tokens: int  # not padding
    sum_sq_len: int  # squared segment lengths, for the attention FLOPs
    data_wait_s: float = 0.0  # this rank's wait for its blocks
    loss_sum: float | None = None  # this rank's; None: not finite, so the optimizer step was skipped
    grad_norm: float | None = None
    lr: float = 0.0


def all_reduced(values, d: Dist, op=dist.ReduceOp.SUM, dtype=None) -> torch.Tensor:
    """values reduced in place over all ranks: a GPU's tensor on the GPU, the host's numbers over d.host_group."""
    tensor = torch.as_tensor(values, dtype=dtype)  # a tensor stays where it is
    dist.all_reduce(tensor, op=op, group=None if tensor.is_cuda else d.host_group)
    return tensor


def global_counts(blocks: list[dict], d: Dist) -> StepStats:  # the loss normaliser, known before the first backward
    rows = [[len(blocks), 0, 0, 0]] + [[0, *(b[k] for k in ("loss_tokens", "tokens", "sum_sq_len"))] for b in blocks]
    local = torch.tensor(rows, dtype=torch.float64).sum(0)
    max_blocks = all_reduced(local[:1].clone(), d, dist.ReduceOp.MAX)
    return StepStats(int(max_blocks), *(int(v) for v in all_reduced(local, d).tolist()))


def to_device(block: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in block.items()}


def run_blocks(model, blocks: list[dict], n_micro: int, filler: dict, cfg: Config, d: Dist, scale: float | None):
    """Forward (and backward of sum(CE) * scale) over n_micro blocks, fillers last: the detached loss sum."""
    loss_sum = torch.zeros((), device=d.device)
    for block in (blocks + [filler] * n_micro)[:n_micro]:  # this rank's blocks, then fillers
        losses = model.token_losses(to_device(block, d.device), cfg.loss_chunk_tokens, scale or 1.0)  # None: no grad
        if scale is not None:
            (losses.sum() * scale).backward()
        loss_sum += losses.detach().sum()
    return loss_sum


def train_step(job: Job, blocks: list[dict], data_wait_s: float = 0.0) -> StepStats:
    """One optimizer step over this rank's blocks, fillers once they run out; none once every rank's have. The loss is
    the global token mean: each rank's backward uses sum(per-token CE) * world_size / all ranks' loss tokens, and FSDP's
    average over ranks cancels world_size. A NaN or inf anywhere reaches every rank's grad norm: all skip alike."""
    cfg, d, progress, optimizer = job.cfg, job.d, job.progress, job.optimizer
    stats = dataclasses.replace(global_counts(blocks, d), data_wait_s=data_wait_s)
    if stats.max_blocks == 0:
        return stats
    assert stats.loss_tokens > 0, "every block has loss tokens (tokenize_stream keeps only samples that do)"
    scale = d.world_size / stats.loss_tokens
    if job.host_moments:
        job.host_moments.to_host()
    loss_sum = run_blocks(job.model, blocks, stats.max_blocks, job.filler, cfg, d, scale)
    if job.step_hook and (replaced := job.step_hook(progress.step + 1, job.model, loss_sum, blocks)) is not None:
        loss_sum = replaced
    if job.host_moments:  # back for the optimizer step; after a skipped one, for a save
        job.host_moments.to_device()
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in job.model.parameters() if p.grad is not None])
    grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
    # Clipped as clip_grad_norm_ clips, by fused AdamW as it reads each gradient (one pass over them fewer)
    optimizer.grad_scale = ((grad_norm.float() + 1e-6) / cfg.max_grad_norm).clamp(min=1.0)  # their divisor
    optimizer.found_inf = (~grad_norm.isfinite()).float()  # a non-finite norm skips the step on the GPU: no wait
    on_host = torch.stack([grad_norm.float(), loss_sum]).to("cpu", non_blocking=True)  # pinned, queued before AdamW:
    copied = torch.cuda.current_stream().record_event().synchronize if d.device.type == "cuda" else lambda: None
    optimizer.step()
    copied()  # the step's one wait for the GPU, for the norm and the loss: the next step queues while AdamW runs
    grad_norm, loss = on_host.tolist()
    if finite := math.isfinite(grad_norm):
        progress.bad_in_a_row = 0
    else:
        progress.bad_steps, progress.bad_in_a_row = progress.bad_steps + 1, progress.bad_in_a_row + 1
        row = f"{progress.bad_in_a_row} in a row, {progress.bad_steps} in all"
        print0(d.rank, f"step {progress.step + 1}: non-finite loss or gradient norm, optimizer step skipped ({row})")
    stats.lr = optimizer.param_groups[0]["lr"]  # this step's, before the scheduler moves on
    job.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    progress.step, stats.loss_sum, stats.grad_norm = progress.step + 1, (loss if finite else None), grad_norm
    return stats


class Operation:  # what the loop drives, each at its own cadence; this one does nothing: it stands in for one off
    last_loss = None  # the log's and the evaluator's last loss

    def after_step(self, job: Job, stats: StepStats) -> None: ...
    def at_end(self, job: Job, why: str) -> None: ...


def training_loop(job: Job, blocks, operations: list[Operation]) -> str:
    """Steps until total_steps; returns why it ended: done, exhausted, stopped (SIGTERM, any rank) or diverged."""
    cfg, progress, data = job.cfg, job.progress, job.progress.blocks_of(blocks, job.cfg.num_workers)
    job.model.train()
    while progress.step < job.total_steps:
        if all_reduced(float(STOP.is_set()), job.d, dist.ReduceOp.MAX):  # any rank's SIGTERM: a checkpoint resumes here
            return "stopped"
        waiting, step_blocks = time.perf_counter(), list(itertools.islice(data, cfg.gradient_accumulation_steps))
        stats = train_step(job, step_blocks, data_wait_s=time.perf_counter() - waiting)
        if stats.max_blocks == 0:
            return "exhausted"
        if progress.bad_in_a_row >= cfg.max_bad_steps:  # every rank agrees: they share the gradient norm
            return "diverged"
        for operation in operations:
            operation.after_step(job, stats)
    return "done"


def run(cfg: Config, d: Dist, step_hook=None) -> dict:
    """The job on this rank: checks, resume point, step count, model, the loop and its end, the export."""
    torch.manual_seed(cfg.seed)
    print0(d.rank, f"configuration:\n{yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)}")
    attn, config, tokenizer = on_every_rank(partial(startup_checks, cfg, d), d)
    resume_from = resume_point(cfg, d)  # the newest intact checkpoint in output_dir, or None
    meta = json.loads((resume_from / "complete.json").read_text()) if resume_from else None  # its step, settings
    progress = resume_progress(resume_from, meta, cfg, d) if meta else Progress()
    if d.rank == 0:  # the settings of this run, once they are known to be usable
        (Path(cfg.output_dir) / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    counted = not (cfg.max_steps or (meta and not meta["config"].get("max_steps")))  # or the checkpoint's count
    passes = cfg.epochs if len(cfg.datasets) > 1 else 1  # a mixture draws each epoch anew: each is counted
    counting = counted and iter(block_loader(cfg, tokenizer, "train", d.rank, d.world_size, passes, counting=True))
    blocks = iter(block_loader(cfg, tokenizer, "train", d.rank, d.world_size, cfg.epochs, progress, not counted))
    source, t0 = on_every_rank(partial(pretrained_dir, cfg), d), time.perf_counter()
    model = build_model(config, cfg, attn, d.device)
    pretrained, compute_dtype = cfg.init == "pretrained", getattr(torch, cfg.param_dtype)  # exported as loaded
    source_dtypes = checkpoint_dtypes(source) if pretrained else dict.fromkeys(model.state_dict(), compute_dtype)
    if pretrained and not meta:  # a resume's weights come with its optimizer's state
        load_pretrained(model, source, source_dtypes)
    elif not meta:  # init: random (benchmarks and tests): the model's own initialiser on this rank's shards
        torch.manual_seed(cfg.seed)
        with torch.no_grad(), implicit_replication():  # implicit_replication: an initialiser that copies a plain
            for module in model.modules():  # tensor into a shard (A_log) copies this rank's slice
                model._init_weights(module)
    ready_s = time.perf_counter() - t0
    if counted:  # the weights are in; what is left of the count is waited for
        max_blocks, packing = count_blocks(counting, cfg, d)
        total_steps = math.ceil(cfg.epochs // passes * max_blocks / cfg.gradient_accumulation_steps)
    else:
        total_steps, packing = cfg.max_steps or meta["total_steps"], None
    optimizer, scheduler = make_optimizer(model, cfg, total_steps)
    if meta:
        resume_weights(resume_from, meta, model, optimizer, scheduler, d)
    measured = recompute_share(cfg.activation_checkpointing) is None and d.device.type == "cuda"  # by RecomputeProbe
    print0(d.rank, describe_model(model, cfg, d, attn, total_steps, ready_s, measured))  # a resume's: its own line
    filler = filler_block(pad_token_id(tokenizer))
    job = Job(cfg, d, model, optimizer, scheduler, total_steps, progress, filler, step_hook)
    with MetricsLog(cfg, d, model, packing) as log:
        evaluator = Evaluator(cfg, tokenizer, d, filler, log) if cfg.eval_split or cfg.eval_fraction else Operation()
        with stop_on_sigterm(), HangWatch(job) as watch:  # first in operations: its at_end gives all a long timeout
            checkpoints = Checkpointer(job, log) if cfg.save_every >= 0 else Operation()
            probe = RecomputeProbe(job) if measured else Operation()
            operations = [watch, log, probe, checkpoints, evaluator]  # the probe: a step's peak before a save or eval
            finish_training(job, training_loop(job, blocks, operations), operations)
        log.summary(job)
        export = export_hf(model, tokenizer, source, source_dtypes, cfg, d) if cfg.export else None
    result = {"steps": progress.step, "final_loss": log.last_loss, "eval_loss": evaluator.last_loss}
    return {**result, "output_dir": cfg.output_dir, "model_dir": str(export) if export else None}


def train(config: Config | dict | str | Path | None = None, step_hook=None) -> dict:
    """This rank's whole job, from main() or a notebook's @distributed function. config: a Config, a dict or YAML path;
    step_hook(step, model, loss_sum, blocks), after each backward (blocks: this rank's), may replace the loss sum."""
    if not isinstance(config, Config):  # a YAML file's path, or a dict (None: the defaults)
        source = yaml_source(config, "train()") if isinstance(config, (str, Path)) else ("train()", config or {})
        config = load_config(source)
    d, lock = setup_distributed(config.output_dir), None
    try:
        with (lock := RunLock(on_every_rank(partial(check_output_dir, config, d), d), d)):
            on_every_rank(partial(stopped_by_a_user_error, config, d), d)  # a restart after one stops at once
            return run(config, d, step_hook)
    except (Exception, dcp.CheckpointException) as e:  # under torchrun, a fault (or a bug) also says what comes next
        if "TORCHELASTIC_RESTART_COUNT" in os.environ and isinstance(e, UserError) and lock:  # not when a live
            stopped_by_a_user_error(config, d, e)  # run's lock refused this one: that output_dir is the live run's
        elif "TORCHELASTIC_RESTART_COUNT" in os.environ and not isinstance(e, (Interrupted, UserError)):
            print(after_a_fault(e, config, d), file=sys.stderr, flush=True)
        raise
    finally:  # this call's groups go: the world if it made it, else its own two (a notebook may call train() again)
        for group in ([None] if d.owns_group else [d.host_group, d.save_group]) if dist.is_initialized() else []:
            dist.destroy_process_group(group)


def main(argv: list[str] | None = None) -> None:
    code = 0
    try:
        train(parse_args(sys.argv[1:] if argv is None else argv)[0])
    except (UserError, Interrupted) as e:  # every rank raises it; a line a node is enough (rank 0's may be any node)
        line, code = (f"error: {e}", 2) if isinstance(e, UserError) else (str(e), 128 + signal.SIGTERM)
        print0(int(os.environ.get("LOCAL_RANK", "0")), line, file=sys.stderr)
    with contextlib.suppress(OSError):  # a pipe closed with the launcher
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # no teardown: gloo's group outlives destroy_process_group, and its threads can abort it (SIGABRT)


# ==== PART II: OPERATIONS (a reader of the recipe may stop here) ==================================================
# ---- Parsing and the resume policy -------------------------------------------------------------------------------
# Each setting's allowed values, lower bound or range (a test, and what the value must be); check_settings has the rest.
CHOICES = dict(init=("pretrained", "random"), reasoning=("train", "drop"), lr_schedule=("cosine", "linear", "constant"))
CHOICES |= dict(attn_implementation=("auto", "flash_attention_2", "torch_varlen", "sdpa", "eager"))
CHOICES |= dict(data_format=("auto", "messages", "prompt_completion", "text"))
CHOICES |= dict.fromkeys(("master_dtype", "param_dtype", "reduce_dtype"), ("bfloat16", "float32"))
LOWEST = dict(max_seq_len=16, save_every=-1, num_workers=0, weight_decay=0, max_steps=0, warmup_steps=0, eval_every=0)
LOWEST |= dict(save_every_minutes=0, eval_blocks=1, pack_buffer_blocks=1, max_bad_steps=1, epochs=1, log_every=1)
LOWEST |= dict(gradient_accumulation_steps=1, loss_chunk_tokens=1, keep_checkpoints=1, collective_timeout_s=1)
RANGES = dict.fromkeys(("eval_fraction", "max_skip_fraction", "min_lr_ratio"), (lambda v: 0 <= v <= 1, "in [0, 1]"))
RANGES |= dict.fromkeys(("adam_beta1", "adam_beta2"), (lambda v: 0 <= v < 1, "in [0, 1)"))
RANGES |= dict(learning_rate=(lambda v: 0 < v < math.inf, "> 0 and finite"), max_grad_norm=(lambda v: v > 0, "> 0"))


def typed(field: dataclasses.Field, value, source: str):  # value as the field's type, or an error naming key and source
    want = type(field.default)
    if want is str and isinstance(value, (int, float)) and not isinstance(value, bool) and "revision" not in field.name:
        value = str(value)  # YAML reads a string that looks like a number (0.75) as one; a revision's (0123) it loses
    if want is bool and isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off"):
        value = value.lower() in ("true", "yes", "on")  # databricks air reads YAML 1.2: no, on... are strings there
    if want is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):  # YAML reads 1e-5 as a string
            value = float(value)
    value = tuple(value) if want is tuple and isinstance(value, list) else value  # YAML's lists: datasets
    if type(value) is not want:
        need = want.__name__ + (" (quoted: YAML read this revision as a number)" if "revision" in field.name else "")
        raise UserError(f"configuration key {field.name!r} (from {source}) must be {need}, got {value!r}")
    return value


def check_settings(cfg: Config) -> None:  # each value in its range (CHOICES, LOWEST, RANGES and the rest here)
    for key, value in dataclasses.asdict(cfg).items():
        need = None
        if key in CHOICES and value not in CHOICES[key]:
            need = f"one of {', '.join(CHOICES[key])}"
        elif key in LOWEST and not value >= LOWEST[key]:  # `not >=`: NaN fails too
            need = f">= {LOWEST[key]}"
        elif key in RANGES and not RANGES[key][0](value):
            need = RANGES[key][1]
        elif key == "activation_checkpointing" and value != "auto":
            need = "auto, or a share in [0, 1]"
            with contextlib.suppress(ValueError):  # not a number: need stays
                need = None if 0 <= recompute_share(value) <= 1 else need
        if need:
            raise UserError(f"bad configuration: {key} must be {need}, got {value!r}")
    types = {"name": str, "split": str, "revision": str, "weight": (int, float)}
    for source in cfg.datasets:
        typed_keys = isinstance(source, dict) and all(isinstance(v, types.get(k, ())) for k, v in source.items())
        if not (typed_keys and "name" in source and 0 < source.get("weight", 1) < math.inf):
            need = "{name: str}, and if wanted split, revision (str), weight (> 0, finite)"
            raise UserError(f"bad configuration: each of datasets must be {need}, got {source!r}")
    defaults = {f.name: f.default for f in dataclasses.fields(cfg) if f.name.startswith("dataset_")}
    if cfg.datasets and (single := [k for k, default in defaults.items() if getattr(cfg, k) not in (default, "")]):
        raise UserError(f"bad configuration: set datasets or {', '.join(single)}, not both")
    if cfg.eval_split and cfg.eval_fraction:
        raise UserError("bad configuration: set eval_split or eval_fraction, not both")
    if cfg.datasets and cfg.eval_split and not data_file(cfg.eval_split):
        raise UserError("bad configuration: with datasets, eval_split must be a local file; or set eval_fraction")
    if cfg.eval_split and data_sources(cfg, "eval")[0]["label"] in [s["label"] for s in data_sources(cfg, "train")]:
        fix = "give a held-out file or split, or set eval_fraction to hold out a share of the records"
        raise UserError(f"bad configuration: eval_split {cfg.eval_split!r} is the training data: {fix}")


def load_config(*sources: tuple[str, dict]) -> Config:  # later sources win; unknown keys and wrong types are named
    fields, values = {f.name: f for f in dataclasses.fields(Config)}, {}
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
    """Config from defaults <- $HYPERPARAMETERS_PATH <- --config FILE <- --key value; help from the fields."""
    usage = "train.py [--config FILE] [--KEY VALUE ...]"
    parser = parser or argparse.ArgumentParser(usage=usage, description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--config", metavar="FILE", help="YAML file of settings (after $HYPERPARAMETERS_PATH's)")
    group = parser.add_argument_group("settings (flags win over files; non-string values are read as YAML: 2e-5, true)")
    for f in dataclasses.fields(Config):
        need = f"; one of {', '.join(CHOICES[f.name])}" if f.name in CHOICES else ""
        need = f"; >= {LOWEST[f.name]}" if f.name in LOWEST else need
        resume = "; may change on resume" if f.metadata["resumable"] else ""
        doc = f"{f.metadata['doc']} (default: {f.default!r}{need}{resume})".replace("%", "%%")
        parse, kind = str if isinstance(f.default, str) else yaml.safe_load, type(f.default).__name__.upper()
        group.add_argument(f"--{f.name}", type=parse, default=argparse.SUPPRESS, metavar=kind, help=doc)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if unknown[0].startswith("--"):  # an unknown key: load_config raises, naming the nearest valid one
            load_config(("command line", {unknown[0][2:].partition("=")[0]: None}))
        raise UserError(f"unexpected argument {unknown[0]!r}; flags are --key value (python train.py --help)")
    params = os.environ.get("HYPERPARAMETERS_PATH")  # a Databricks workload's parameters: block
    sources = [yaml_source(p, name) for p, name in ((params, "HYPERPARAMETERS_PATH"), (args.config, "--config")) if p]
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if hasattr(args, f.name)}
    return load_config(*sources, ("command line", flags)), args


def fixed_on_resume(saved: dict, cfg: Config) -> dict:
    """{key: (old, new)} that cfg changes but may not; a key an older checkpoint lacks counts as its default."""
    fields, new = {f.name: f for f in dataclasses.fields(cfg)}, json.loads(json.dumps(dataclasses.asdict(cfg)))
    old = json.loads(json.dumps({k: saved.get(k, f.default) for k, f in fields.items()}))  # as JSON: lists, not tuples
    return {k: (old[k], new[k]) for k, f in fields.items() if not f.metadata["resumable"] and old[k] != new[k]}


# ---- Startup checks (what can fail without the weights fails first, on every rank alike), the counting pass ------
def exit_with_launcher(launcher: int) -> None:  # in a thread: torchrun, killed alone, would leave its workers training
    while os.getppid() == launcher:  # they have sessions of their own
        time.sleep(1)
    with contextlib.suppress(OSError):  # the output may have been a pipe to the launcher's reader, gone with it
        print(f"rank {os.environ.get('RANK')}: the launcher (pid {launcher}) is gone: exiting", flush=True)
    os._exit(1)


def on_every_rank(check, d: Dist):  # a UserError on any rank is raised on all, naming it: no rank waits in a collective
    try:
        result, error = check(), None
    except UserError as e:
        result, error = None, f"{e} (rank {d.rank})" if d.world_size > 1 else str(e)
    errors = [None] * d.world_size
    dist.all_gather_object(errors, error)
    if first := next((e for e in errors if e), None):
        raise UserError(first)
    return result


def decided_by_rank_0(decide, failure: str, d: Dist):  # ranks must not branch on their own views of a file system
    outcome = [None, None]  # (result, error)
    if d.rank == 0:
        try:
            outcome[0] = decide()
        except (OSError, ValueError) as e:  # a UserError (a ValueError) as it is
            outcome[1] = str(e) if isinstance(e, UserError) else f"{failure}: {e}"
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1]:
        raise UserError(outcome[1])
    return outcome[0]


def check_output_dir(cfg: Config, d: Dist) -> Path:  # each rank writes its shards there: checked before anything loads
    out, probe = Path(cfg.output_dir), Path(cfg.output_dir) / f".write-test-rank{d.rank}"
    if cfg.export and Path(cfg.model_name).resolve() == (out / "model").resolve():  # export_hf empties it first
        raise UserError(f"model_name is {out}/model, which the export replaces: train from a copy of it")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        fix = "set output_dir to a directory (or Unity Catalog volume path) this job can write"
        raise UserError(f"output_dir {out} is not writable from rank {d.rank} ({e.strerror}): {fix}") from e
    return out


def check_tracking_store(rank: int) -> None:  # tried first: a store MetricsLog cannot use would stop the run late
    if rank or not ((run_id := os.environ.get("MLFLOW_RUN_ID")) or os.environ.get("MLFLOW_TRACKING_URI")):
        return
    mlflow = importlib.import_module("mlflow")  # imported only where a tracking store is set
    try:  # the cheapest call that needs the store: the platform's run, or one experiment
        client = mlflow.MlflowClient()
        client.get_run(run_id) if run_id else client.search_experiments(max_results=1)
    except (mlflow.exceptions.MlflowException, OSError, ImportError, ValueError) as e:  # ImportError: no db driver
        cause = e  # the innermost: "[Errno 111] Connection refused", not the URL (and any password in it) thrice
        while cause.__cause__ or cause.__context__:
            cause = cause.__cause__ or cause.__context__
        problem = str(cause).strip().partition("\n")[0][:160] or type(cause).__name__
        uri = mlflow.get_tracking_uri()  # without the user:password@ it may hold
        uri = f"{uri.partition('://')[0]}://{uri.rpartition('@')[2]}" if "@" in uri else uri
        fix = "a file: store needs MLFLOW_ALLOW_FILE_STORE=true, a server the right URI, credentials and MLFLOW_RUN_ID"
        raise UserError(f"MLflow tracking store {uri} cannot be used ({problem}): {fix}") from e


def startup_checks(cfg: Config, d: Dist):  # (attention, model config, tokenizer), checked before the weights load
    attn = resolve_attention(cfg.attn_implementation, d.device)
    config = model_config(cfg.model_name, cfg.model_revision, cfg.trust_remote_code)
    require_kernels(config)
    if (limit := getattr(config.get_text_config(), "max_position_embeddings", None)) and cfg.max_seq_len > limit:
        raise UserError(f"max_seq_len {cfg.max_seq_len} exceeds the model's max_position_embeddings {limit}")
    if cfg.float8 and (d.device.type != "cuda" or torch.cuda.get_device_capability(d.device) < (8, 9)):
        raise UserError("float8 needs an NVIDIA GPU with float8 matmuls (Hopper or newer); set float8: false")
    if cfg.float8 and importlib.util.find_spec("torchao") is None:
        raise UserError("float8 needs torchao: pip install torchao==0.18.0")
    check_tracking_store(d.rank)  # MetricsLog's (rank 0 logs): before the tokenizer and the weights load
    tokenizer = load_tokenizer(cfg)
    for part in ["train"] + (["eval"] if cfg.eval_split else []):
        check_data(cfg, part)
    return attn, config, tokenizer


def resolve_attention(requested: str, device: torch.device) -> str:
    has_flash_attn = importlib.util.find_spec("flash_attn") is not None
    if requested == "auto":  # flash-attn if installed, else torch_varlen on CUDA, else sdpa (mask from position_ids)
        requested = "flash_attention_2" if has_flash_attn else "torch_varlen" if device.type == "cuda" else "sdpa"
    if requested == "flash_attention_2" and not has_flash_attn:
        fix = "pip install flash-attn --no-build-isolation, or use torch_varlen (CUDA) / sdpa"
        raise UserError(f"attn_implementation=flash_attention_2 needs flash-attn: {fix}")
    if requested == "torch_varlen":
        if device.type != "cuda" or importlib.util.find_spec("torch.nn.attention.varlen") is None:
            raise UserError("attn_implementation=torch_varlen needs CUDA and torch >= 2.10; use sdpa on CPU")
        from transformers import AttentionInterface

        AttentionInterface.register("torch_varlen", torch_varlen_attention)
    return requested


def require_kernels(config) -> None:  # without them transformers refuses packed signals or leaks state across them
    if "linear_attention" not in (getattr(config.get_text_config(), "layer_types", None) or []):
        return
    needed = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}
    if missing := " and ".join(pkg for module, pkg in needed.items() if importlib.util.find_spec(module) is None):
        fix = "pip install flash-linear-attention==0.6.0, and build causal-conv1d 1.7.0 against your torch"
        fix += " (workload.yaml's setup does both: README, 'Run it on GPUs')"
        raise UserError(f"{config.model_type} has linear-attention layers and needs {missing}: {fix}")
    guard = importlib.import_module("fla.ops.common.chunk_o")  # fla's own guard of the Gated DeltaNet backward
    tilelang_backend = importlib.import_module("fla.ops.common.backends.tilelang").CommonTileLangBackend
    guarded = guard.IS_NVIDIA_HOPPER and guard.TRITON_ABOVE_3_4_0 and not guard.TRITON_ABOVE_3_7_1  # [3.4, 3.7.1)
    if guarded and not tilelang_backend.can_use():
        why = "flash-linear-attention refuses the Gated DeltaNet backward on this Hopper GPU with this Triton (>= 3.4,"
        why += " < 3.7.1 computes its gradients wrongly there, fla issue #640) and has no TileLang backend instead"
        fix = "pip install tilelang==0.1.15 (workload.yaml's setup does) and put nvcc on PATH, or use torch >= 2.12.1"
        raise UserError(f"{why}: {fix}")


def check_data(cfg: Config, part: str) -> None:  # a source missing, unreadable, empty or of no known form stops the run
    for source in data_sources(cfg, part):
        name, where, reasons = source["name"], source["label"], []
        if data_file(name) and not Path(name).is_file():
            raise UserError(f"data file {name} does not exist")
        try:  # datasets: ValueError for a split or configuration it lacks, OSError for what it cannot reach
            first = [decoded(record) for _, record in itertools.islice(source_records(source), 64)]
        except (ValueError, OSError) as e:
            raise UserError(f"cannot read dataset {where}: " + str(e).strip().split("\n")[0]) from e
        if not any(record is not None for record in first):
            raise UserError(f"dataset {where} {'has no readable line: is it JSON lines?' if first else 'is empty'}")
        for record in first:
            try:
                record_form(record, cfg)
                break
            except Skip as reason:
                reasons.append(str(reason))
        else:
            columns = sorted(next((record for record in first if isinstance(record, dict)), {}))
            fix = "give messages or conversations, prompt and completion, or text; or set messages_column, data_format"
            raise UserError(f"dataset {where} has {reasons[0]} in its first records (its columns: {columns}); {fix}")


def from_hub(load, name: str):  # a hub load; a gated or private repo without a token: an error saying what to do
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        return load()
    except (OSError, GatedRepoError, RepositoryNotFoundError) as e:
        cause = e if isinstance(e, (GatedRepoError, RepositoryNotFoundError)) else e.__cause__
        if isinstance(cause, (GatedRepoError, RepositoryNotFoundError)) and not os.environ.get("HF_TOKEN"):
            fix = "accept its license on the hub, then set HF_TOKEN (in a workload: secrets: {HF_TOKEN: scope/key})"
            raise UserError(f"{name} is gated or private and HF_TOKEN is not set: {fix}") from e
        first_line = str(e).strip().split("\n")[0]
        raise UserError(f"cannot load {name}: {first_line} (a local directory, or the hub name and network?)") from e


def pretrained_dir(cfg: Config) -> Path:
    if not (path := Path(cfg.model_name)).is_dir():  # else its hub snapshot, downloaded once per node (hub file locks)
        files = ["*.json", "*.jinja", "*.txt", "*.model"] + (["*.safetensors"] if cfg.init == "pretrained" else [])
        from huggingface_hub import snapshot_download

        download = partial(snapshot_download, cfg.model_name, revision=cfg.model_revision or None, allow_patterns=files)
        path = Path(from_hub(download, cfg.model_name))
    if cfg.init == "pretrained" and not any(path.glob("*.safetensors")):  # safetensors only
        fix = "(pickled .bin files can run code): convert it with save_pretrained(safe_serialization=True)"
        raise UserError(f"{cfg.model_name} has no .safetensors weights, and this recipe reads no other format {fix}")
    return path


def checkpoint_dtypes(path: Path) -> dict:  # the indexed tensors: not those of Mistral's consolidated.safetensors too
    metadata = HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata  # the safetensors headers
    named = json.loads(i.read_text())["weight_map"] if (i := path / "model.safetensors.index.json").exists() else {}
    return {name: meta.properties.dtype for name, meta in metadata.items() if name in named or not named}


def launched_s_ago() -> str:  # this process's age (Linux): its imports, startup checks and all that came before
    with contextlib.suppress(OSError, ValueError):
        started = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
        return f", {float(Path('/proc/uptime').read_text().split()[0]) - started:.1f}s after launch"
    return ""


def describe_model(model, cfg: Config, d: Dist, attn: str, total_steps: int, seconds: float, measured: bool) -> str:
    layers = model.get_decoder().layers  # the log's lines on the model, and the numbers derived from the settings
    recomputed = f"{sum(getattr(layer, 'gradient_checkpointing', False) for layer in layers)} recomputed"
    recomputed += " until activation_checkpointing auto decides" if measured else ""
    line = f"model: {model.config.model_type}, {sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M parameters, "
    line += f"{len(layers)} decoder layers ({recomputed}{', norms and MLPs compiled' if cfg.compile else ''}), "
    line += f"attention {attn}, sharded over {d.world_size} ranks, {cfg.init} weights, ready in {seconds:.1f}s"
    line += f"{launched_s_ago()}, peak host memory {rss_gib():.1f} GiB on rank 0\n"
    line += f"derived: world_size {d.world_size} | device {d.device.type} | steps {total_steps} | tokens per step "
    line += f"{cfg.gradient_accumulation_steps * d.world_size * cfg.max_seq_len:,} | torch {torch.__version__} | "
    warmup = "\nwarning: warmup_steps >= steps: lr stays below learning_rate" if cfg.warmup_steps >= total_steps else ""
    return f"{line}transformers {importlib.metadata.version('transformers')}{warmup}"


class CountedBlocks(PackedBlocks):  # the counting pass's stream: its blocks counted in its worker, its end handed over
    progress_every_s = 60  # a large dataset takes minutes: show that it moves

    def __iter__(self):  # with no block to hand over, the worker counts on while its process loads the weights
        t0 = shown = time.monotonic()
        sums = Counter(blocks=0, tokens=0, loss_tokens=0)  # on Linux the worker dies with its rank (PDEATHSIG)
        for item in super().__iter__():  # the blocks, then the stream's end (no block), with its records' counts
            if "input_ids" in item:
                sums.update(blocks=1, tokens=item["tokens"], loss_tokens=item["loss_tokens"])
                if time.monotonic() - shown > self.progress_every_s:
                    shown, n, at = time.monotonic(), sums["blocks"], item["position"]
                    print0(self.rank, f"counting: {n:,} blocks so far, rank 0 stream {at.slot}, {at.record:,} records")
        yield {**sums, "position": item["position"], "seconds": time.monotonic() - t0}


def count_blocks(counting, cfg: Config, d: Dist) -> tuple[int, dict]:  # the exact step count; bad data before a step
    waiting, ends = time.monotonic(), list(counting)  # each worker's stream's end, its sums and its records' counts
    mine = [sum(end[k] for end in ends) for k in ("blocks", "tokens", "loss_tokens")]
    totals, counted = [None] * d.world_size, max(end["seconds"] for end in ends)
    dist.all_gather_object(totals, (*mine, sum((Counter(e["position"].counts_at_end) for e in ends), Counter())))
    blocks_per_rank, counts = [t[0] for t in totals], sum((Counter(t[3]) for t in totals), Counter())
    capacity, skipped = max(1, sum(blocks_per_rank) * cfg.max_seq_len), skip_reasons(counts)
    stats = {"blocks": sum(blocks_per_rank), "blocks_per_rank_min_max": [min(blocks_per_rank), max(blocks_per_rank)]}
    fill, loss_fill = (round(sum(t[k] for t in totals) / capacity, 4) for k in (1, 2))
    stats |= {"conversations": counts["conversations"], "non_padding_fraction": fill, "loss_token_fraction": loss_fill}
    stats |= {"extra_samples_for_reasoning": counts[EXTRA_SAMPLES], "truncated": counts["truncated"]}
    stats |= {"skipped": sum(skipped.values()), "skipped_by_reason": skipped}
    stats |= {"by_source": sources} if (sources := by_source(counts, cfg)) else {}
    print0(d.rank, f"data: {json.dumps(stats)} (counted in {counted:.1f}s, waited {time.monotonic() - waiting:.1f}s)")
    if max(blocks_per_rank) == 0:
        names = ", ".join(source["label"] for source in data_sources(cfg, "train"))
        raise UserError(f"no trainable conversation in {names}: {stats}")
    check_skips(stats["skipped"], stats["skipped"] + stats["conversations"], lambda: skipped, cfg)
    return max(blocks_per_rank), stats


def check_skips(skipped: int, records: int, reasons, cfg: Config) -> None:  # reasons(): theirs, maybe a collective
    if records and skipped / records > cfg.max_skip_fraction:  # counts over all ranks: every rank decides alike
        limit, fix = f"more than max_skip_fraction {cfg.max_skip_fraction}", "Fix the data, or raise max_skip_fraction"
        raise UserError(f"{skipped} of {records} records cannot be trained on ({limit}): {reasons()}. {fix}")


def gathered(counts: Counter, d: Dist) -> Counter:  # the sum of every rank's
    every = [None] * d.world_size
    dist.all_gather_object(every, counts)
    return sum(every, Counter())


# ---- Checkpoints and resume --------------------------------------------------------------------------------------
def complete_checkpoints(cfg: Config) -> list[Path]:  # finished by every rank: complete.json is written last
    return sorted(p for p in (Path(cfg.output_dir) / "checkpoints").glob("step_*") if (p / "complete.json").exists())


def newest_checkpoint(cfg: Config) -> str:
    return str((complete_checkpoints(cfg) or ["none (save_every: -1)" if cfg.save_every < 0 else "none"])[-1])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()  # read whole: only files under 64 MiB are hashed (finish)


def checkpoint_problem(path: Path) -> str | None:  # what is wrong with it by complete.json's sizes and hashes, or None
    try:
        meta = json.loads((path / "complete.json").read_text())
        if name := next((n for n, size in meta["files"].items() if (path / n).stat().st_size != size), None):
            return f"{name} has {(path / name).stat().st_size} bytes, {meta['files'][name]} were written"
        if name := next((n for n, digest in meta["sha256"].items() if sha256(path / n) != digest), None):
            return f"{name} differs from what was written"
    except (FileNotFoundError, KeyError, ValueError, AttributeError, TypeError) as e:  # a missing file, a broken json
        return f"{type(e).__name__}: {e}"


def resume_point(cfg: Config, d: Dist) -> Path | None:  # the newest complete checkpoint without a problem
    def newest_intact() -> Path | None:  # rank 0's: each newer one with a problem is set aside
        candidates = complete_checkpoints(cfg)
        for path in reversed(candidates):
            if not (problem := checkpoint_problem(path)):
                return path
            aside = path.rename(path.with_name(f"rejected-{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"))
            print(f"warning: checkpoint {path} is damaged ({problem}): set aside as {aside.name}", flush=True)
        if candidates:
            raise UserError(f"every checkpoint in {path.parent} is damaged (set aside as rejected-*); start again")

    return decided_by_rank_0(newest_intact, f"cannot read the checkpoints in {cfg.output_dir}", d)


def resume_progress(path: Path, meta: dict, cfg: Config, d: Dist) -> Progress:  # sets the RNG states; needs no model
    if (ranks := meta["world_size"]) != d.world_size:
        raise UserError(f"{path} was written by {ranks} ranks; resume with as many, or use another output_dir")
    if fixed := fixed_on_resume(meta["config"], cfg):
        changes = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in sorted(fixed.items()))
        line = f"{path} was written with other {sorted(fixed)} ({changes}): a resumed run keeps the data layout, the"
        raise UserError(f"{line} batch and the optimizer of its checkpoint. Restore them, or use another output_dir")
    now = json.loads(json.dumps(dataclasses.asdict(cfg)))  # as JSON, as saved: lists, not tuples
    if changed := {k: v for k, v in now.items() if meta["config"].get(k) != v}:
        print0(d.rank, f"resuming with configuration changes: {changed}")
    saved = torch.load(path / f"rank_{d.rank:05d}.pt", weights_only=False)  # our own file: RNG tuples
    torch.set_rng_state(saved["rng"]["torch"])
    random.setstate(saved["rng"]["python"])
    if "cuda" in saved["rng"]:
        torch.cuda.set_rng_state(saved["rng"]["cuda"], d.device)
    state = saved["progress"]  # dataclasses.asdict of a Progress
    if any("carried" not in p for p in state["streams"].values()):  # each buffer then packed alone: other blocks
        raise UserError(f"{path} was written by a train.py that packed differently: resume it with that version")
    return Progress(**{**state, "streams": {s: StreamPosition(**p) for s, p in state["streams"].items()}})


def resume_weights(path: Path, meta: dict, model, optimizer, scheduler, d: Dist) -> None:
    t0, step = time.perf_counter(), f"step {meta['step']} of {meta['total_steps']}"
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    scheduler.load_state_dict(meta["scheduler"] | {"last_epoch": meta["step"] - 1})  # then stepped to the step:
    scheduler.step()  # the lr follows this run's total_steps from its first step on (the saved lr, the saved run's)
    print0(d.rank, f"resumed from {path} ({step}) in {time.perf_counter() - t0:.1f}s")


def walk_tensors(value, fn, key: tuple = ()):  # a nested state's copy, each tensor as fn(its key path, the tensor)
    if isinstance(value, dict):
        return {k: walk_tensors(v, fn, (*key, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [walk_tensors(v, fn, (*key, i)) for i, v in enumerate(value)]
    return fn(key, value) if isinstance(value, torch.Tensor) else value


def host_buffer(like: torch.Tensor) -> torch.Tensor:  # like's shape and dtype on the host; pinned for a GPU's copies
    buffer = torch.empty(like.shape, dtype=like.dtype)
    if like.is_cuda and buffer.nbytes:  # in place: PyTorch's pinned allocator rounds up to 2^n
        with torch.cuda.device(like.device):  # in like's GPU's context: a new thread's (prepare's) is GPU 0's
            torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0)
        weakref.finalize(buffer, torch.cuda.cudart().cudaHostUnregister, buffer.data_ptr())
    return buffer


class Checkpointer(Operation, AsyncStager):  # sharded DCP checkpoints (model, AdamW, each rank's Progress and RNG)
    _synchronize_after_execute = False  # as DCP's stager: stage() returns the copy complete

    def __init__(self, job: Job, log: MetricsLog | None = None):  # run() builds it only when save_every >= 0
        self.job, self.log, self.pending, self.buffers, self.preparing = job, log, None, {}, None
        self.last, self.saved_step = time.monotonic(), job.progress.step or None  # a resumed run starts at a save
        self.group = job.d.save_group  # saves wait on it: a long timeout, not collective_timeout_s
        if job.cfg.async_save:  # the staged copy's host memory (weights, AdamW's moments)
            ranks, gib = int(os.environ.get("LOCAL_WORLD_SIZE", job.d.world_size)), 2**30
            rank = sum(p.to_local().nbytes * (3 if p.requires_grad else 1) for p in job.model.parameters()) / gib
            node = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / gib
            warn = " -- over 80% of it: expect swapping, or set async_save: false" if ranks * rank > 0.8 * node else ""
            line = f"async_save: {rank:.1f} GiB of host memory per rank for the staged checkpoint, {ranks * rank:.1f}"
            print0(job.d.rank, f"{line} GiB on this node of {node:.0f} GiB{warn}")

    def after_step(self, job: Job, stats: StepStats) -> None:
        if self.pending and self.pending[0] and not all_reduced(int(not self.pending[0].done()), job.d):
            self.finish()  # no rank's background write is still running
        self.prepare()
        due = job.cfg.save_every > 0 and job.progress.step % job.cfg.save_every == 0
        if not due and job.cfg.save_every_minutes:  # after the last save, by any rank's clock
            late = float(time.monotonic() - self.last >= 60 * job.cfg.save_every_minutes)
            due = bool(all_reduced(late, job.d, dist.ReduceOp.MAX))
        if due and job.progress.step < job.total_steps:
            self.save()

    def at_end(self, job: Job, why: str) -> None:
        if why != "diverged" and job.progress.step != self.saved_step:
            self.save()
        self.finish()

    def state(self) -> dict:
        return dict(zip(("model", "optimizer"), get_state_dict(self.job.model, self.job.optimizer)))

    def save(self) -> None:
        if self.log:
            self.log.flush(self.job)  # a checkpoint holds no open window
        self.finish()  # the write in flight, if any
        job, d, progress = self.job, self.job.d, self.job.progress
        t0, path = time.perf_counter(), Path(job.cfg.output_dir) / "checkpoints" / f"step_{progress.step:08d}"
        if d.rank == 0 and path.exists():  # an earlier, interrupted save of this step
            shutil.rmtree(path)
        dist.barrier(self.group)
        path.mkdir(parents=True, exist_ok=True)  # a background write creates it only later
        state, future = self.state(), None
        if job.cfg.async_save:  # the copy (self.stage) is taken before the next step changes the weights
            future = dcp.async_save(state, checkpoint_id=str(path), process_group=self.group, async_stager=self)
        else:
            dcp.save(state, checkpoint_id=str(path), process_group=self.group)
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        rng |= {"cuda": torch.cuda.get_rng_state(d.device)} if d.device.type == "cuda" else {}
        torch.save({"progress": dataclasses.asdict(progress), "rng": rng}, path / f"rank_{d.rank:05d}.pt")
        meta = {"step": progress.step, "total_steps": job.total_steps, "world_size": d.world_size}
        meta |= {"scheduler": job.scheduler.state_dict(), "config": dataclasses.asdict(job.cfg)}
        self.pending, self.last = (future, path, meta, t0, time.perf_counter() - t0), time.monotonic()
        self.saved_step = progress.step
        if not future:
            self.finish()

    def prepare(self) -> None:  # once AdamW's state exists, a thread allocates and pins the staging buffers
        if self.preparing or self.buffers or not self.job.optimizer.state or not self.job.cfg.async_save:
            return
        layout = []  # each rank-local tensor, whose shape and dtype the thread reads
        walk_tensors(self.state(), lambda key, v: layout.append((key, v.to_local() if isinstance(v, DTensor) else v)))
        self.preparing = threading.Thread(target=lambda: [self.buffer(key, like) for key, like in layout], daemon=True)
        self.preparing.start()

    def buffer(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        if (buffer := self.buffers.get(key)) is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            self.buffers[key] = buffer = host_buffer(like)
        return buffer

    @torch.no_grad()
    def stage(self, state: dict) -> dict:  # host copies, DTensors over a CPU mesh (docs/CHECKPOINTS.md: why not DCP's)
        if self.preparing:  # the first save, if it comes before the buffers are ready, waits for them (later: at once)
            self.preparing.join()
        self.mesh = getattr(self, "mesh", None) or dist.DeviceMesh.from_group(self.group, "cpu")

        def host(key, value):
            local = value.to_local() if isinstance(value, DTensor) else value
            buffer = self.buffer(key, local).copy_(local, non_blocking=local.is_cuda)  # into pinned memory
            if not isinstance(value, DTensor):
                return buffer
            shape, stride = value.shape, value.stride()
            return DTensor.from_local(buffer, self.mesh, value.placements, run_check=False, shape=shape, stride=stride)

        staged = walk_tensors(state, host)
        if self.job.d.device.type == "cuda":  # the non_blocking copies are done before stage() returns
            torch.cuda.synchronize()
        return staged

    def finish(self) -> None:  # waits for the write in flight; rank 0 then writes complete.json, removes the old
        if not self.pending:
            return
        (future, path, meta, t0, stall), cfg = self.pending, self.job.cfg
        if future:
            future.result()  # raises what the write raised
        dist.barrier(self.group)  # every rank has written its part
        self.pending = None
        if self.job.d.rank == 0:
            files = {f.name: f.stat().st_size for f in sorted(path.iterdir())}  # what a resume verifies cheaply
            small = {name: sha256(path / name) for name, size in files.items() if size < 2**26}  # .metadata, ranks'
            meta.update(files=files, sha256=small, bytes=sum(files.values()), seconds=time.perf_counter() - t0)
            (path / "complete.json.tmp").write_text(json.dumps(meta, indent=1))
            os.replace(path / "complete.json.tmp", path / "complete.json")
            complete = complete_checkpoints(cfg)
            unfinished = [p for p in path.parent.glob("step_*") if p not in complete and p.name < path.name]
            for old in complete[: -cfg.keep_checkpoints] + unfinished:
                shutil.rmtree(old)
            line = f"checkpoint step {meta['step']}: {meta['bytes'] / 2**30:.2f} GiB in {meta['seconds']:.1f}s"
            print(f"{line} (training stalled {stall:.1f}s) -> {path}", flush=True)
        dist.barrier(self.group)  # rank 0's part (slow on a volume) is waited for here, not in a training collective


# ---- The recompute probe: activation_checkpointing auto ----------------------------------------------------------
class RecomputeProbe(Operation):  # auto (README, "Model"): step 1 measures each layer's parts, later steps keep some
    def __init__(self, job: Job):
        self.job, self.layers = job, job.model.get_decoder().layers
        job.host_moments = HostMoments(job.optimizer, job.d.device)  # in step 1; a resume's would add to its peak
        self.parts = [(i, name, m) for i, layer in enumerate(self.layers) for name, m in recomputable_parts(layer)]
        self.bytes, self.events, self.seconds = [0] * len(self.parts), [None] * len(self.parts), None
        self.kept, self.retries, self.clean_steps, self.watching, self.growing = None, 0, 0, True, False
        self.checkpoint_funcs, classes = [layer._gradient_checkpointing_func for layer in self.layers], {}
        for layer, checkpoint_func in zip(self.layers, self.checkpoint_funcs):  # each recomputation runs to its end
            layer._gradient_checkpointing_func = partial(self.checkpoint, checkpoint_func)
        for j, (_, _, part) in enumerate(self.parts):  # one class per kind (torch.compile's guards check the class)
            part.__class__ = classes.setdefault(type(part), type(type(part).__name__, (RecomputedPart, type(part)), {}))
            part.measure = partial(self.measure, j)  # outside the part's compiled forward, which hooks are not

    @staticmethod
    def checkpoint(checkpoint_func, *args):
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # without early stop, which ends a recomputation
            return checkpoint_func(*args)  # before the forward returns (read per call: nothing outlives it)

    def measure(self, j: int, forward, *args, **kwargs):
        start, allocated = torch.cuda.Event(enable_timing=True), torch.cuda.memory_allocated()
        start.record()
        output, end = forward(*args, **kwargs), torch.cuda.Event(enable_timing=True)
        end.record()
        outputs, part_input = output if isinstance(output, tuple) else (output,), (*args, *kwargs.values())[0]
        kept = torch.cuda.memory_allocated() - allocated - sum(t.nbytes for t in outputs if torch.is_tensor(t))
        kept += getattr(part_input, "nbytes", 0)  # kept too once the part is (the whole layer keeps only its own)
        self.bytes[j], self.events[j] = max(self.bytes[j], kept), (start, end)  # the last call's: a recomputation
        return output

    def after_step(self, job: Job, stats: StepStats) -> None:  # step 1 measures, then each step watches, from step 2
        if stats.max_blocks == 0 or not self.watching:  # a step without blocks ran nothing (a non-finite one did)
            return
        if self.seconds is None:  # step 1 measured: the layers get their own checkpoint functions back
            torch.cuda.synchronize()  # then CUDA's stack limit (0) at its default: step 1's autotuning trials reserved
            if torch.version.cuda:  # a ROCm build has no libcuda
                ctypes.CDLL("libcuda.so.1").cuCtxSetLimit(0, ctypes.c_size_t(1024))  # 6.5 GiB
            for layer, checkpoint_func in zip(self.layers, self.checkpoint_funcs):
                layer._gradient_checkpointing_func = checkpoint_func
            for _, _, part in self.parts:
                part.measure = None
            self.seconds = [e[0].elapsed_time(e[1]) / 1e3 if e else 0.0 for e in self.events]  # None: never called
            moments, peak = sum(m.nbytes for m in job.host_moments.moments()), job.host_moments.peak  # before AdamW
            if (room := self.room(peak + moments, unplanned=0.02)) >= 0:  # made them: a later step needs about as much
                job.host_moments = None  # they fit beside step 1's peak: on the GPU, where its optimizer step left them
            else:  # e.g. 256k tokens on one H200: 0.8 s each way for the 8-layer geometry's (docs/LONG_BLOCKS.md)
                line = f"step 1 peaked at {peak / 2**30:.1f} GiB with every layer recomputed, {-room / 2**30:.1f} GiB"
                line += f" short of room for AdamW's moments ({moments / 2**30:.1f} GiB): they leave the GPU for each"
                print0(job.d.rank, f"activation_checkpointing auto: {line} forward and backward, to pinned host memory")
            torch.cuda.reset_peak_memory_stats()  # the baseline's peak from here, after step 1's log line read its own
        elif self.kept is None:  # step 2's peak, every layer recomputed, is the baseline: the watch keeps parts
            costs = all_reduced([*self.bytes, *self.seconds], job.d, dist.ReduceOp.MAX, torch.float64)
            (self.sizes, self.seconds), n = costs.view(2, -1).tolist(), len(self.layers)
            each = f"{sum(self.sizes) / n / 2**30:.2f} GiB and {1e3 * sum(self.seconds) / n:.0f} ms per layer"
            print0(job.d.rank, f"activation_checkpointing auto: recomputation measured, {each}")
            gathered = sum(p.numel() for p in self.layers.parameters()) * getattr(torch, job.cfg.param_dtype).itemsize
            self.sizes, self.seconds = self.sizes + [gathered], self.seconds + [0.0]  # last: gathered parameters kept
            self.kept, self.retries, self.growing = [], alloc_retries(), True
            self.watch()
        else:
            self.watching = not self.watch()

    def room(self, peak: float, unplanned: float = 0.1) -> float:  # what a peak leaves on every rank, less a share
        free, total = torch.cuda.mem_get_info()  # of the GPU's unplanned: fragmentation, peaks unmeasured (NCCL's)
        self.limit = torch.cuda.get_per_process_memory_fraction() * total  # a cap set on this process, if any
        usable = min(free + torch.cuda.memory_reserved(), self.limit)
        return all_reduced(usable - unplanned * self.limit - peak, self.job.d, dist.ReduceOp.MIN, torch.float64).item()

    def watch(self) -> bool:  # each step: retries give back a kept part; room left beside the peak keeps more
        retries, peak, step = alloc_retries(), torch.cuda.max_memory_allocated(), self.job.progress.step
        new = all_reduced(retries - self.retries, self.job.d, dist.ReduceOp.MAX).item()  # any rank's retries
        self.retries, self.clean_steps, self.growing = retries, self.clean_steps + 1, self.growing and not new
        names = [f"{i}.{name}" for i, name, _ in self.parts] + ["gathered parameters"]
        if new and self.kept:  # after allocator retries the part kept last is recomputed again, and no more kept
            given_back, self.clean_steps = names[self.kept.pop()], 0
            line = f"step {step}: {new} allocation retries, {given_back} back; {len(self.kept)} of {len(names)} kept"
        elif self.growing and (more := parts_to_keep(self.sizes, self.seconds, self.room(peak), self.kept)):
            self.kept, self.clean_steps = self.kept + more, 0  # measured peaks correct the sizes' error
            line = f"step {step}: peak {peak / 2**30:.1f} GiB, room for {[names[j] for j in more]} too"
        for i, layer in enumerate(self.layers):  # a layer whose parts are all recomputed is recomputed whole
            parts = [(j, part) for j, (k, _, part) in enumerate(self.parts) if k == i]
            layer.gradient_checkpointing = all(j not in self.kept for j, _ in parts)
            for j, part in parts:
                part.recomputed = j not in self.kept and not layer.gradient_checkpointing
            layer.set_reshard_after_forward(len(self.parts) not in self.kept)  # FSDP2's, kept or not
        if self.clean_steps == 0:  # a part given back or more kept this step
            print0(self.job.d.rank, f"activation_checkpointing auto: {line}")
        return self.clean_steps >= 10  # ten steps in a row without an allocator retry end the watch


class RecomputedPart:  # auto: a layer's token mixer or MLP recomputed alone in backward, the rest of the layer kept
    recomputed, measure = False, None  # measure: the probe's, in step 1

    def __call__(self, *args, **kwargs):
        if self.measure:
            return self.measure(super().__call__, *args, **kwargs)
        if not (self.recomputed and torch.is_grad_enabled()):
            return super().__call__(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(super().__call__, *args, use_reentrant=False, **kwargs)


def recomputable_parts(layer) -> list:  # its children with weights but norms: the token mixer and the MLP
    return [(n, m) for n, m in layer.named_children() if list(m.parameters()) and not type(m).__name__.endswith("Norm")]


class HostMoments:  # AdamW's moments in host memory (pinned on GPUs) for each forward and backward, back for the step
    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer, self.buffers, self.on_host, self.peak = optimizer, [], False, None  # peak: to_device's
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # the copies out, beside the forward

    def moments(self) -> list[torch.Tensor]:  # rank-local, each with a storage of its own: zeros_like(p) or a load's
        moments = [state[k] for state in self.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        return [m.to_local() if isinstance(m, DTensor) else m for m in moments]

    @torch.no_grad()
    def to_host(self) -> None:  # copied into the same buffers every step, beside the forward; their memory freed
        moments, self.on_host, pinned = [] if self.on_host else self.moments(), True, self.stream is not None
        self.buffers = self.buffers or [host_buffer(m) for m in moments]
        if pinned:  # after the last optimizer step
            self.stream.wait_stream(torch.cuda.current_stream())
        for moment, buffer in zip(moments, self.buffers):
            assert moment.untyped_storage().nbytes() == moment.nbytes, "a moment shares its storage: it cannot move"
            with torch.cuda.stream(self.stream):  # None (CPU): a plain copy
                buffer.copy_(moment, non_blocking=pinned)
            if pinned:  # the allocator gives the memory to the forward only once the copy has read it
                moment.record_stream(self.stream)
            moment.untyped_storage().resize_(0)
        if pinned and self.peak is None:  # step 1's forward next: auto's peak from here, not the load's (a resume's
            torch.cuda.reset_peak_memory_stats()  # moments, freed just now, included)

    @torch.no_grad()
    def to_device(self) -> None:  # their memory given back, and filled in stream order before the step reads it
        self.peak = torch.cuda.max_memory_allocated()  # the forward's and backward's, before the moments: auto's rule
        if self.stream and self.on_host:
            torch.cuda.current_stream().wait_stream(self.stream)  # the copies out are done with the host buffers
        for moment, buffer in zip(self.moments() if self.on_host else [], self.buffers):
            moment.untyped_storage().resize_(moment.nbytes)
            moment.copy_(buffer, non_blocking=self.stream is not None)
        self.on_host = False


def parts_to_keep(sizes: list[float], seconds: list[float], room: float, kept=()) -> list[int]:
    more = []  # the items (parts, gathered parameters) to keep beside those kept, most time per byte first, in room
    for i in sorted(range(len(sizes)), key=lambda i: -seconds[i] / max(sizes[i], 1)):
        if i not in kept and sizes[i] <= room:
            more.append(i)
            room -= sizes[i]
    return more


def alloc_retries() -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0)  # CUDA's, since the start (each a stall)


# ---- Metrics, MLflow, eval, and hangs -----------------------------------------------------------------------------
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H100": 989e12, "H200": 989e12}
PEAK_BF16_FLOPS |= {"B200": 2250e12, "B300": 2250e12, "A100": 312e12}  # dense bf16 FLOP/s, NVIDIA's datasheets


def matmul_params(model) -> int:  # the parameters costing 2 FLOPs per token forward
    return sum(map(torch.numel, model.get_decoder().layers.parameters())) + model.get_output_embeddings().weight.numel()


def attention_flops_per_sq_token(model) -> int:  # FLOPs per squared segment length (Gated DeltaNet's < 0.5%: left out)
    text = model.config.get_text_config()
    kinds = getattr(text, "layer_types", None) or ["full"] * text.num_hidden_layers
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 6 * sum(t != "linear_attention" for t in kinds) * text.num_attention_heads * head_dim


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process's peak; KiB on Linux


class MetricsLog(Operation, contextlib.AbstractContextManager):  # rank 0's line per log_every steps over all ranks
    def __init__(self, cfg: Config, d: Dist, model, packing: dict | None = None):
        self.cfg, self.d, self.mlflow, self.device = cfg, d, None, "gpu" if d.device.type == "cuda" else "cpu"
        if d.rank == 0 and ((run_id := os.environ.get("MLFLOW_RUN_ID")) or os.environ.get("MLFLOW_TRACKING_URI")):
            mlflow = importlib.import_module("mlflow")  # imported only where a tracking store is set
            run = mlflow.start_run(run_id=run_id)  # the platform's (or a notebook decorator's) run, or a new one
            mlflow.log_params({k: str(v) for k, v in dataclasses.asdict(cfg).items() if k not in run.data.params})
            self.mlflow, self.run_id = mlflow, run_id  # params cannot change: a resumed run logs only the new ones
        self.n_matmul, self.attn_per_sq = matmul_params(model), attention_flops_per_sq_token(model)
        name = torch.cuda.get_device_name() if d.device.type == "cuda" else ""
        self.peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)  # the first key it contains
        self.start = self.since = time.perf_counter()
        self.loss_sum, self.window, self.grad_norm = 0.0, Counter(), None
        if packing:
            self.write({"step": 0, "packing": packing})

    def __exit__(self, kind, error, traceback) -> None:  # as a context, it ends the MLflow run
        if self.mlflow:  # a job's run must not read as a success when it failed
            self.mlflow.end_run("FINISHED" if kind is None else "KILLED" if issubclass(kind, Interrupted) else "FAILED")
            os.environ.update({"MLFLOW_RUN_ID": self.run_id} if self.run_id else {})  # unset by end_run; train() again

    def after_step(self, job: Job, stats: StepStats) -> None:
        if stats.loss_sum is not None:  # a skipped step's loss is left out of the mean
            self.loss_sum += stats.loss_sum
            self.window["stepped_loss_tokens"] += stats.loss_tokens
        self.window.update({k: getattr(stats, k) for k in ("blocks", "tokens", "loss_tokens", "data_wait_s")}, steps=1)
        self.window["flops"] += 6 * self.n_matmul * stats.tokens + self.attn_per_sq * stats.sum_sq_len
        self.grad_norm, self.lr = stats.grad_norm, stats.lr  # the log's: the last step's, not a mean over the window
        if self.window["steps"] == 1 and self.since == self.start:  # a new machine's compiles and autotuning
            print0(self.d.rank, f"first step took {time.perf_counter() - self.start:.1f}s{launched_s_ago()}")
        if job.progress.step % self.cfg.log_every == 0 or job.progress.step == job.total_steps:
            self.flush(job)

    def at_end(self, job: Job, why: str) -> None:
        if why != "diverged":
            self.flush(job)

    def flush(self, job: Job) -> None:  # logs the steps since the last line, if any; checks the skipped records' share
        if not self.window["steps"]:
            return
        data = job.progress.stream_counts()
        skipped = sum(skip_reasons(data).values())  # this rank's; the totals are over all ranks
        sums = all_reduced([self.loss_sum, skipped, skipped + data["conversations"]], self.d, dtype=torch.float64)
        loss, skips = sums[0].item() / (self.window["stepped_loss_tokens"] or math.nan), sums[1:]  # all skipped: nan
        retries = alloc_retries() if self.d.device.type == "cuda" else 0  # one rank's stall (data, allocator) is all's
        stalls = all_reduced([self.window["data_wait_s"], retries], self.d, dist.ReduceOp.MAX, torch.float64)
        now, c, step, ranks, u = time.perf_counter(), self.window, job.progress.step, self.d.world_size, self.device
        seconds, capacity, gpu_s = now - self.since, c["blocks"] * self.cfg.max_seq_len, (now - self.since) * ranks
        r = {"step": step, "total_steps": job.total_steps, "loss": loss, "lr": self.lr, "grad_norm": self.grad_norm}
        r |= {"tokens_per_s_per_gpu": c["tokens"] / gpu_s, "loss_tokens_per_s_per_gpu": c["loss_tokens"] / gpu_s}
        r |= {"non_padding_fraction": c["tokens"] / capacity, "loss_token_fraction": c["loss_tokens"] / capacity}
        r |= {"mfu": c["flops"] / gpu_s / self.peak if self.peak else None}
        r |= {"memory_gib": torch.cuda.max_memory_allocated() / 2**30 if self.d.device.type == "cuda" else rss_gib()}
        r |= {"data_wait_s": float(stalls[0]), "alloc_retries": int(stalls[1])}  # most on a rank; retries since start
        r |= {"eta_s": (job.total_steps - step) * seconds / c["steps"], "skipped_records": int(skips[0])}
        r |= {"bad_steps": job.progress.bad_steps, "elapsed_s": now - self.start, "time": time.time()}
        mfu, eta = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-", timedelta(seconds=int(r["eta_s"]))
        speed = f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/{u} | {r['loss_tokens_per_s_per_gpu']:,.0f} loss-tok/s/{u}"
        line = f"step {step}/{job.total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | grad {r['grad_norm']:.3f}"
        print0(self.d.rank, f"{line} | {speed} | mfu {mfu} | mem {r['memory_gib']:.1f} GiB | eta {eta}")
        self.write(r)
        check_skips(int(skips[0]), int(skips[1]), lambda: skip_reasons(gathered(data, self.d)), self.cfg)
        self.since, self.window, self.last_loss, self.loss_sum = now, Counter(), r["loss"], 0.0

    def write(self, record: dict) -> None:
        if self.d.rank == 0:
            with open(Path(self.cfg.output_dir) / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.mlflow:  # numbers, nested ones as key/name, in the characters MLflow takes (no "(", "//", "/.")
            pairs = [(k, v) for k, v in record.items() if k not in ("step", "total_steps", "time")]
            pairs += [(f"{k}/{n}", v) for k, sub in record.items() if isinstance(sub, dict) for n, v in sub.items()]
            flat = {re.sub(r"[^/\w.\- ]|/(?=[/.]|$)", "_", k): v for k, v in pairs if isinstance(v, (int, float))}
            try:  # a tracking-server hiccup must not end a week-long run
                self.mlflow.log_metrics(flat, step=record["step"])
            except Exception as e:
                print(f"warning: MLflow log_metrics failed ({e}); metrics.jsonl has the record", flush=True)

    def summary(self, job: Job) -> None:  # the run's last line: steps, final loss, the data seen on all ranks
        counts = gathered(job.progress.stream_counts() + Counter(blocks=job.progress.blocks), self.d)
        data = {k: v for k, v in counts.items() if isinstance(k, str)}
        data |= {"by_source": sources} if (sources := by_source(counts, self.cfg)) else {}
        trained = f"final loss {self.last_loss}" if self.last_loss is not None else "none in this run"
        print0(self.d.rank, f"done: {job.progress.step} steps, {trained}, data seen {data}")
        self.write({"step": job.progress.step, "data_seen": data})


class Evaluator(Operation):  # held-out loss (token-weighted, eval_blocks per rank) every eval_every steps, at the end
    def __init__(self, cfg: Config, tokenizer, d: Dist, filler: dict, log: MetricsLog):
        self.cfg, self.d, self.filler, self.log = cfg, d, filler, log
        in_process = dataclasses.replace(cfg, num_workers=0, pack_buffer_blocks=cfg.eval_blocks)  # a few blocks, once
        loader = block_loader(in_process, tokenizer, "eval", d.rank, d.world_size, epochs=1)
        self.blocks = list(itertools.islice((b for b in loader if "input_ids" in b), cfg.eval_blocks))
        self.n_micro, self.loss_tokens = (counts := global_counts(self.blocks, d)).max_blocks, counts.loss_tokens
        if self.loss_tokens == 0:
            raise UserError(f"the eval data yields no loss tokens: {[s['label'] for s in data_sources(cfg, 'eval')]}")

    def after_step(self, job: Job, stats: StepStats) -> None:
        if self.cfg.eval_every and job.progress.step % self.cfg.eval_every == 0 and job.progress.step < job.total_steps:
            self.evaluate(job.model, job.progress.step)

    def at_end(self, job: Job, why: str) -> None:
        if why in ("done", "exhausted"):
            self.evaluate(job.model, job.progress.step)

    @torch.no_grad()
    def evaluate(self, model, step: int) -> None:
        model.eval()
        loss_sum = run_blocks(model, self.blocks, self.n_micro, self.filler, self.cfg, self.d, scale=None)
        model.train()
        self.last_loss = all_reduced(loss_sum, self.d).item() / self.loss_tokens
        print0(self.d.rank, f"eval step {step} | loss {self.last_loss:.4f}")
        self.log.write({"step": step, "eval_loss": self.last_loss})


class HangWatch(Operation, contextlib.AbstractContextManager):  # a waiting rank names the silent ones (beats)
    def __init__(self, job: Job):
        self.job, self.done, self.last, self.said = job, threading.Event(), None, False  # last: this rank's last step

    def after_step(self, job: Job, stats: StepStats) -> None:
        started, self.last, self.said = self.last is not None, time.monotonic(), False
        if not started:  # from the first step's end a collective waits collective_timeout_s (inf: 1e7 s)
            for group in (None, job.d.host_group):  # the training's collectives and the host's numbers
                dist.distributed_c10d._set_pg_timeout(timedelta(seconds=min(job.cfg.collective_timeout_s, 1e7)), group)
            threading.Thread(target=self.watch, args=(dist.distributed_c10d._get_default_store(),), daemon=True).start()

    def at_end(self, job: Job, why: str) -> None:
        self.done.set()  # on leaving its with too: the final save, eval, export, a notebook's next run wait long again
        for group in (None, self.job.d.host_group) if self.last is not None else ():
            dist.distributed_c10d._set_pg_timeout(STARTUP_TIMEOUT, group)

    def __exit__(self, *exc) -> None:
        self.at_end(self.job, "left")

    def watch(self, store) -> None:
        d, timeout, beat_s, pause = self.job.d, self.job.cfg.collective_timeout_s, 5.0, 0.0
        while not self.done.wait(pause):  # a beat now, then one every beat_s
            pause = beat_s
            with contextlib.suppress(RuntimeError):  # the store is gone with the run: so is the watch
                store.set(f"beat/{d.rank}", str(time.time()))
            if self.said or (waited := time.monotonic() - self.last) < 0.8 * timeout:
                continue
            now, keys = time.time(), [f"beat/{r}" for r in range(d.world_size)]
            beats = [float(store.get(k)) if store.check([k]) else None for k in keys]
            silent = [f"rank {r} ({'no beat' if t is None else f'{now - t:.0f} s'})" for r, t in enumerate(beats)]
            silent = [text for text, t in zip(silent, beats) if t is None or t < now - 2 * beat_s]
            line = f"rank {d.rank}: no step has ended for {waited:.0f} s (next: step {self.job.progress.step + 1}); "
            line += f"silent ranks: {', '.join(silent) or 'none (each prints where it is)'}; a training collective"
            line += f" times out at {timeout:.0f} s, a save waits up to {STARTUP_TIMEOUT}. Where this rank is:"
            print(line, file=sys.__stderr__, flush=True)  # with its stack, to the process's own stderr (as SIGUSR1's)
            faulthandler.dump_traceback(sys.__stderr__)
            self.said = True


def stopped_by_a_user_error(cfg: Config, d: Dist, error: UserError | None = None) -> None:
    """torchrun restarts on any exit: a UserError left in output_dir stops the next attempt at once, before loading."""
    path, attempt = Path(cfg.output_dir) / "user_error.json", int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    earlier, message = attempt, ""
    with contextlib.suppress(FileNotFoundError, ValueError):  # none, or written halfway: a restart loads again
        earlier, message = json.loads(path.read_text()) if attempt else (attempt, "")
    if error is None and earlier < attempt:
        raise UserError(f"{message} (the attempt before this restart stopped on it)")
    with contextlib.suppress(OSError):  # an output_dir that cannot be written: its own error says so
        if d.rank == 0 and error:  # the first message is kept, however many attempts stop on it
            path.write_text(json.dumps([attempt, message or str(error)]))
        elif d.rank == 0 and attempt == 0:  # a new run: an old run's message must not stop its restarts
            path.unlink(missing_ok=True)


def after_a_fault(e: BaseException, cfg: Config, d: Dist) -> str:
    env = os.environ.get  # under torchrun the workers restart (--max-restarts) and resume; the last attempt ends it
    attempt, restarts = int(env("TORCHELASTIC_RESTART_COUNT", "0")), int(env("TORCHELASTIC_MAX_RESTARTS", "0"))
    lines = str(e).strip().splitlines() or [""]  # DCP's CheckpointException: its ranks, their tracebacks, the cause
    fault = f"rank {d.rank}: {type(e).__name__}: {lines[-1 if isinstance(e, dcp.CheckpointException) else 0][:240]}"
    if attempt < restarts:
        return f"{fault}\nattempt {attempt + 1} of {restarts + 1} failed: torchrun restarts the workers, which resume"
    newest = newest_checkpoint(cfg)
    return f"{fault}\nthe last of {restarts + 1} attempts failed: the job stops; its newest checkpoint is {newest}"


# ---- The run lock, SIGTERM, the end of training, and the Hugging Face export ---------------------------------------
class RunLock(contextlib.AbstractContextManager):  # run.lock: a second run refuses; a dead one's is taken over
    def __init__(self, out: Path, d: Dist):
        self.path, self.d, self.released = out / "run.lock", d, threading.Event()
        started = time.strftime("%Y-%m-%d %H:%M:%S")  # run: this run's id, whatever pid a restarted container gets
        self.me = {"host": os.uname().nodename, "pid": os.getpid(), "started": started, "run": os.urandom(8).hex()}
        decided_by_rank_0(self.acquire, f"cannot take the lock {self.path}", d)
        if d.rank == 0:
            threading.Thread(target=self.refresh, name="run-lock", daemon=True).start()

    def acquire(self) -> None:
        try:  # a lock file that cannot be read (written halfway by a writer that died) is no lock
            holder = json.loads(self.path.read_text())
            age, host, pid = time.time() - self.path.stat().st_mtime, holder["host"], int(holder["pid"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            holder = None
        if holder:  # held: refreshed in the last 2 minutes, and not by this host's gone pid or this pid (a restart)
            if age < 120 and not (host == self.me["host"] and (pid == os.getpid() or not pid_alive(pid))):
                who = f"host {host}, pid {pid}, started {holder.get('started')}, alive {age:.0f}s ago"
                fix = f"use another output_dir, or remove {self.path} if that run is gone"
                raise UserError(f"output_dir {self.path.parent} is in use by another run ({who}): {fix}")
            print(f"taking over the lock of a run that is gone: {holder}", flush=True)
        (tmp := self.path.with_name(f"run.lock.{self.me['run']}")).write_text(json.dumps(self.me))
        os.replace(tmp, self.path)  # whole or not at all
        time.sleep(0.2)  # two runs that took the lock at once: the last write stays, the other refuses
        if json.loads(self.path.read_text()) != self.me:
            raise UserError(f"output_dir {self.path.parent} was just taken")

    def refresh(self) -> None:  # a run frozen for minutes may find its lock taken over: it stops at once
        while not self.released.wait(30):
            with contextlib.suppress(OSError, ValueError):  # a file system hiccup: the next refresh may do
                if (holder := json.loads(self.path.read_text())) != self.me and not self.released.is_set():
                    print(f"error: another run took over {self.path} ({holder}): exiting", file=sys.stderr)
                    os._exit(2)  # before this run writes a checkpoint beside that run's
                os.utime(self.path)

    def __exit__(self, *exc) -> None:
        self.released.set()  # only rank 0 has a refresh thread to stop
        with contextlib.suppress(OSError, ValueError):
            if self.d.rank == 0 and json.loads(self.path.read_text()) == self.me:
                self.path.unlink()


def pid_alive(pid: int) -> bool:
    with contextlib.suppress(ProcessLookupError):
        with contextlib.suppress(PermissionError):  # it exists, as another user's
            os.kill(pid, 0)
        return True
    return False


class Interrupted(Exception): ...  # SIGTERM reached a rank: raised on all once its checkpoint is complete (exit 143)


@contextlib.contextmanager
def stop_on_sigterm():  # while training, SIGTERM asks the loop to stop and save, instead of ending the process at once
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: STOP.set())
    try:
        yield
    finally:  # after a fault the launcher's SIGTERM would cut short the rank's report of it: it only sets STOP then
        if sys.exc_info()[0] is None:
            signal.signal(signal.SIGTERM, previous)
        late = STOP.is_set()
        STOP.clear()
    if late:  # during the final eval or save, after the last check: the export is left to the restart
        raise Interrupted("stopped by SIGTERM after the last step; its checkpoint, if any, is complete")


def start_data_worker(rank_pid: int, worker_id: int) -> None:  # SIGTERM is for the rank; a worker dies with it
    os.setpgrp()  # out of the process group torchrun signals; on Linux it dies with the rank, and its socket copies
    if sys.platform == "linux" and ctypes.CDLL(None).prctl(1, signal.SIGKILL) == 0 and os.getppid() != rank_pid:
        os._exit(0)  # the rank ended before the prctl: no signal would come


def finish_training(job: Job, why: str, operations: list[Operation]) -> None:  # after the loop; some ends are errors
    cfg, d, step = job.cfg, job.d, job.progress.step
    if why == "stopped":
        print0(d.rank, f"SIGTERM: stopping after step {step}, once its checkpoint is written")
    elif why == "exhausted":
        print0(d.rank, f"data exhausted on every rank after {step} of {job.total_steps} steps")
    if step == 0 and why == "stopped":
        raise Interrupted("stopped by SIGTERM before the first step")
    if step == 0:  # every rank agrees: e.g. max_steps given, and every conversation truncated to nothing
        seen = {k: v for k, v in job.progress.stream_counts().items() if isinstance(k, str)}
        raise UserError(f"no step was trained: the data holds nothing to learn from (rank {d.rank}: {seen})")
    for operation in operations:
        operation.at_end(job, why)
    if why == "stopped":
        raise Interrupted(f"stopped by SIGTERM after step {step}; the newest checkpoint is {newest_checkpoint(cfg)}")
    if why == "diverged":
        bad = f"{cfg.max_bad_steps} steps in a row with a non-finite loss or gradient norm at step {step}: stopping"
        fix = "look at the data, or set a lower learning_rate in a new output_dir (a resume refuses a changed one)"
        raise UserError(f"{bad}. The last checkpoint is {newest_checkpoint(cfg)}; {fix}")


TOKENIZER_FILES = """tokenizer.json tokenizer_config.json special_tokens_map.json added_tokens.json chat_template.jinja
chat_template.json vocab.json merges.txt tokenizer.model tokenizer.model.v3 spiece.model tekken.json""".split()


def stop_at_end_of_turn(out: Path, tokenizer, model_config) -> None:  # eos_token_id gains the end-of-turn token
    from transformers import GenerationConfig

    saved = (out / "generation_config.json").exists()
    config = GenerationConfig.from_pretrained(out) if saved else GenerationConfig.from_model_config(model_config)
    eos = {*(config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id])}
    with contextlib.suppress(Skip):  # the last token of an assistant turn's loss span is its end-of-turn token
        turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        ids, mask = AssistantMasker(tokenizer)(turn)
        eos.add(ids[max(i for i, m in enumerate(mask) if m)])
    config.eos_token_id = sorted((eos | {tokenizer.eos_token_id}) - {None})
    config.save_pretrained(out)  # generate() then stops where the model learned to


def export_hf(model, tokenizer, source: Path, source_dtypes: dict, cfg: Config, d: Dist) -> Path:
    """output_dir/model: the Hugging Face checkpoint in the source's dtypes, files and configs; its tokenizer ours."""
    t0, out, index_file = time.perf_counter(), Path(cfg.output_dir) / "model", source / "model.safetensors.index.json"
    if d.rank == 0 and out.exists():
        shutil.rmtree(out)
    dist.barrier()
    source_files = json.loads(index_file.read_text())["weight_map"] if index_file.exists() else {}
    file_number = {name: n for n, name in enumerate(sorted(set(source_files.values())), 1)}
    state = {k: v.to(source_dtypes[k]) for k, v in model.state_dict().items() if k in source_dtypes}
    layout = {k: file_number.get(source_files.get(k), 1) for k in state}
    kwargs = dict(save_distributed=True, enable_consolidation=True, thread_count_consolidation=8)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=layout, **kwargs))
    dist.barrier()
    if d.rank == 0:
        shutil.rmtree(out / "sharded")
        if extra := sorted(set(source_dtypes) - set(state)):  # e.g. mtp.*: copied as is, to an indexed file of its own
            tensors, index = {}, json.loads((out / "model.safetensors.index.json").read_text())
            for name in extra:
                with safetensors.safe_open(source / source_files.get(name, "model.safetensors"), "pt") as f:
                    tensors[name] = f.get_tensor(name)
            safetensors.torch.save_file(tensors, out / "model-extra.safetensors", metadata={"format": "pt"})
            index["weight_map"].update(dict.fromkeys(extra, "model-extra.safetensors"))
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        for f in source.iterdir():  # configs (processors' too), code, license; not weights, not the tokenizer's
            skipped = f.name in TOKENIZER_FILES or f.suffix == ".tiktoken" or f.name.endswith(".index.json")
            if f.is_file() and f.suffix in (".json", ".py", ".md", ".txt", "") and not skipped:
                shutil.copy(f, out / f.name)
        tokenizer.save_pretrained(out)  # the tokenizer trained with (tokenizer_name's): special tokens, chat template
        stop_at_end_of_turn(out, tokenizer, model.config)
        size, seconds = sum(f.stat().st_size for f in out.iterdir()) / 2**30, time.perf_counter() - t0
        print(f"exported {len(state) + len(extra)} tensors, {size:.2f} GiB in {seconds:.1f}s -> {out}", flush=True)
    dist.barrier()
    return out


if __name__ == "__main__":
    main()
