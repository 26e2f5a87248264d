"""Users' data as they have it: each record's form found from its keys, with its loss rule; several sources mixed
by weight, seeded, sharded and resumed exactly; a bad line said once."""

import copy
import itertools
import json
import re
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import SAMPLE, TORCHRUN, run, stream_blocks, worker_env, write_tiny_job
from test_masks import loss_runs, skip_reason

import train

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris"}}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": WEATHER}]},
    {"role": "tool", "content": "18C"},
    {"role": "assistant", "content": "18C in Paris."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "Rain."},
]
SHAREGPT = [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "Weather in Paris?"},
    {"from": "function_call", "value": json.dumps(WEATHER)},
    {"from": "observation", "value": "18C"},
    {"from": "gpt", "value": "18C in Paris."},
    {"from": "human", "value": "And tomorrow?"},
    {"from": "gpt", "value": "Rain."},
]


def samples(record, tokenizer, **settings):
    return train.samples_of(record, train.AssistantMasker(tokenizer), train.Config(**settings))


def test_a_sharegpt_record_trains_exactly_as_the_same_messages(tokenizer):
    [(ids, mask)] = samples({"messages": MESSAGES}, tokenizer)
    assert samples({"conversations": SHAREGPT}, tokenizer) == [(ids, mask)]
    runs = loss_runs(tokenizer, ids, mask)
    assert len(runs) == 3 and "get_weather" in runs[0] and runs[1:] == ["18C in Paris.<|im_end|>", "Rain.<|im_end|>"]
    named = samples({"dialogue": SHAREGPT}, tokenizer, messages_column="dialogue")  # any column, by messages_column
    assert named == [(ids, mask)]


def test_a_conversational_prompt_and_completion_trains_the_completions_turns_only(tokenizer):
    """The same rendering as the whole conversation, its mask without the prompt's assistant turns."""
    prompt, completion = MESSAGES[:6], MESSAGES[6:]
    [(ids, mask)] = samples({"prompt": prompt, "completion": completion}, tokenizer)
    [(whole_ids, whole_mask)] = samples({"messages": MESSAGES}, tokenizer)
    assert ids == whole_ids and loss_runs(tokenizer, ids, mask) == ["Rain.<|im_end|>"]
    completion_start = len(ids) - len(tokenizer(completion[0]["content"] + "<|im_end|>\n")["input_ids"])
    assert mask == [m and i >= completion_start for i, m in enumerate(whole_mask)]
    assert skip_reason(lambda: samples({"prompt": prompt, "completion": [MESSAGES[1]]}, tokenizer)) == (
        "no assistant turn in the completion"
    )
    mixed = {"prompt": "Weather in Paris?", "completion": completion}
    assert skip_reason(lambda: samples(mixed, tokenizer)) == "prompt and completion neither strings nor message lists"


def test_plain_prompt_and_completion_and_text_train_without_a_template_as_trl_does(tokenizer):
    """Strings: the prompt tokenized as for generation, then the completion and end-of-sequence carry the loss; a
    text record carries it on every token. No chat template is needed."""
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    eos = tokenizer.eos_token_id
    prompt_ids = tokenizer("The capital of France is")["input_ids"]
    completion_ids = tokenizer(" Paris.", add_special_tokens=False)["input_ids"] + [eos]
    for tok in (tokenizer, bare):
        [(ids, mask)] = samples({"prompt": "The capital of France is", "completion": " Paris."}, tok)
        assert ids == prompt_ids + completion_ids and mask == [False] * len(prompt_ids) + [True] * len(completion_ids)
        [(ids, mask)] = samples({"text": "Once upon a time."}, tok)
        assert tokenizer.decode(ids) == "Once upon a time.<|im_end|>" and all(mask)
    block = train.make_block([(ids, mask)], 32, 0)  # every token a target but the first, which has no predecessor
    assert block["labels"][0, 1 : len(ids)].tolist() == ids[1:] and block["loss_tokens"] == len(ids) - 1
    no_template = skip_reason(lambda: samples({"messages": MESSAGES}, bare))
    assert no_template.startswith("a conversation, and the tokenizer has no chat_template")
    assert skip_reason(lambda: samples({"text": "  "}, tokenizer)) == "empty or non-string text or completion"


def test_the_form_is_found_from_the_keys_unless_data_format_names_it(tokenizer):
    both = {"messages": MESSAGES, "text": "the conversation, rendered elsewhere"}
    assert samples(both, tokenizer) == samples({"messages": MESSAGES}, tokenizer)  # messages come first
    assert samples(both, tokenizer, data_format="text") == samples({"text": both["text"]}, tokenizer)
    pair = {"prompt": "2+2=", "completion": "4", "text": "2+2=4"}
    assert samples(pair, tokenizer) == samples({"prompt": "2+2=", "completion": "4"}, tokenizer)
    assert skip_reason(lambda: samples({"question": "?"}, tokenizer)) == "no column of a known form"
    wrong = lambda: samples({"messages": MESSAGES}, tokenizer, data_format="prompt_completion")  # noqa: E731
    assert skip_reason(wrong) == "no column of the form prompt_completion"


def test_inspect_data_shows_every_form_with_its_loss_spans(tiny_model_dir, tmp_path):
    data = tmp_path / "forms.jsonl"
    records = [
        {"conversations": SHAREGPT},
        {"prompt": [MESSAGES[1]], "completion": [{"role": "assistant", "content": "Sunny, 18C."}]},
        {"prompt": "The capital of France is", "completion": " Paris."},
        {"text": "Once upon a time."},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    command = [sys.executable, "tools/inspect_data.py", "4", "--dataset_name", str(data), "--max_seq_len", "512"]
    command += ["--model_name", str(tiny_model_dir), "--model_revision", ""]
    rc, out, err = run(command, timeout=60)
    assert rc == 0, err
    for trained in ("⟦Rain.<|im_end|>⟧", "⟦Sunny, 18C.<|im_end|>⟧", "France is⟦ Paris.<|im_end|>⟧"):
        assert trained in out
    [text] = [line for line in out.splitlines() if "upon a time" in line]
    assert text.endswith("a time.<|im_end|>⟧") and text.count("⟦") == 1  # every token but the first, its target
    assert "conversations 4" in out and "skipped {}" in out


def write_texts(path, tag: str, n: int, bad: set = frozenset()):
    """n records {"text": "<tag> <i>"}; those in bad are not JSON."""
    lines = ["{not json\n" if i in bad else json.dumps({"text": f"{tag} {i}"}) + "\n" for i in range(n)]
    path.write_text("".join(lines))
    return str(path)


@pytest.fixture()
def two_sources(tmp_path):
    big, small = write_texts(tmp_path / "big.jsonl", "big", 30), write_texts(tmp_path / "small.jsonl", "small", 5)
    return ({"name": big, "weight": 3}, {"name": small, "weight": 1})


def stream(cfg, part="train", shard=0, num_shards=1, start=0, epoch=0):
    records = train.read_records(cfg, part, shard, num_shards, start, Counter(), epoch)
    return [(index, record["text"], source) for index, record, source in records]


def test_several_sources_are_interleaved_by_weight_seeded_until_each_has_run_out_once(two_sources):
    cfg = train.Config(datasets=two_sources)
    whole = stream(cfg)
    texts = [text for _, text, _ in whole]
    assert [index for index, _, _ in whole] == list(range(len(whole)))
    assert [t for t in texts if t.startswith("big")] == [f"big {i}" for i in range(30)]  # once, in order
    small = [t for t in texts if t.startswith("small")]
    assert small == [f"small {i % 5}" for i in range(len(small))] and len(small) > 5  # read again while big lasts
    assert 0.1 < len(small) / len(whole) < 0.45  # weight 1 of 4
    assert whole == stream(cfg) and whole != stream(train.Config(datasets=two_sources, seed=1))
    assert whole != stream(cfg, epoch=1)  # each epoch its own interleave
    one = stream(train.Config(dataset_name=two_sources[1]["name"]))
    assert one == stream(train.Config(datasets=two_sources[1:])) == [(i, f"small {i}", 0) for i in range(5)]


def test_mixed_shards_are_disjoint_resume_at_any_record_and_hold_out_the_same_records_in_every_pass(two_sources):
    cfg = train.Config(datasets=two_sources)
    whole = stream(cfg)
    shards = [stream(cfg, shard=s, num_shards=3) for s in range(3)]
    assert sorted(itertools.chain(*shards)) == whole and all(i % 3 == s for s in range(3) for i, _, _ in shards[s])
    assert stream(cfg, start=17) == whole[17:]
    held = train.Config(datasets=two_sources, eval_fraction=0.3)
    trained, held_out = {t for _, t, _ in stream(held)}, {t for _, t, _ in stream(held, "eval")}
    assert trained and held_out and not trained & held_out and trained | held_out == {t for _, t, _ in whole}


def test_a_mixed_stream_stopped_in_a_carried_buffer_resumes_on_the_same_blocks(tokenizer, tmp_path):
    lines = open(SAMPLE).readlines()
    (tmp_path / "a.jsonl").write_text("".join(lines[:60]))
    sharegpt = [{"conversations": [{"from": {"user": "human"}.get(m["role"], "gpt"), "value": m["content"]} for m in
                 json.loads(line)["messages"]]} for line in lines[60:90]]  # fmt: skip
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sharegpt))
    datasets = ({"name": str(tmp_path / "a.jsonl")}, {"name": str(tmp_path / "b.jsonl"), "weight": 2})
    cfg = train.Config(datasets=datasets, max_seq_len=1024, pack_buffer_blocks=2, num_workers=2)

    blocks = partial(stream_blocks, cfg, tokenizer)

    whole = blocks(train.Progress())
    stopped = train.Progress()
    first = blocks(stopped, n=7)
    assert any(p.carried for p in stopped.streams.values()) and len(whole) > 12
    rest = blocks(train.Progress(), resume=stopped)
    assert len(first + rest) == len(whole) and all(torch.equal(a, b) for a, b in zip(first + rest, whole))


def test_counts_are_kept_by_source_and_add_up_to_the_totals(tokenizer, tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(open(SAMPLE).readlines()[:10]))
    bad = write_texts(tmp_path / "bad.jsonl", "bad", 6, bad={1, 4})
    cfg = train.Config(datasets=({"name": str(good)}, {"name": bad}), max_seq_len=2048)
    counts = [b for b in train.PackedBlocks(cfg, tokenizer, "train", 0, 1, epochs=1)][-1]["position"].counts_at_end
    by = train.by_source(counts, cfg)
    assert by[str(good)]["conversations"] == 10 and "unreadable line" not in by[str(good)]
    assert by[bad]["unreadable line"] >= 2 and by[bad]["conversations"] >= 4  # text records: trained
    assert sum(source["conversations"] for source in by.values()) == counts["conversations"]
    assert sum(source.get("unreadable line", 0) for source in by.values()) == counts["unreadable line"]
    assert all(source["loss tokens"] <= source["tokens"] for source in by.values())
    assert train.by_source(counts, train.Config(dataset_name=str(good))) == {}  # one source: the totals say it


def test_one_split_at_two_revisions_is_counted_as_two_sources():
    cfg = train.Config(datasets=({"name": "org/chats", "revision": "v1"}, {"name": "org/chats", "revision": "v2"}))
    counts = Counter({(0, "conversations"): 3, (1, "conversations"): 4, "conversations": 7})
    assert train.by_source(counts, cfg) == {
        "org/chats [train] @v1": {"conversations": 3},
        "org/chats [train] @v2": {"conversations": 4},
    }


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"datasets": [{"path": "a.jsonl"}]}, "each of datasets must be {name: str}"),
        ({"datasets": ["a.jsonl"]}, "each of datasets must be {name: str}"),
        ({"datasets": [{"name": "a.jsonl", "weight": 0}]}, "each of datasets must be {name: str}"),
        ({"datasets": [{"name": "a.jsonl"}], "dataset_name": "b.jsonl"}, "set datasets or dataset_name, not both"),
        ({"datasets": [{"name": "a.jsonl"}], "eval_split": "test"}, "with datasets, eval_split must be a local file"),
        ({"datasets": [{"name": "a.jsonl"}, {"name": "b.jsonl"}], "eval_split": "b.jsonl"}, "is the training data"),
    ],
)
def test_bad_datasets_are_refused_in_one_line(settings, message):
    with pytest.raises(train.UserError, match=re.escape(message)):
        train.load_config(("test", settings))


def test_datasets_from_yaml_and_the_command_line(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("datasets:\n  - {name: a.jsonl, weight: 3}\n  - name: org/chats\n    split: train\n")
    cfg, _ = train.parse_args(["--config", str(job)])
    assert train.data_sources(cfg, "train") == [
        {"name": "a.jsonl", "split": "train", "revision": "", "weight": 3, "label": str(Path("a.jsonl").resolve())},
        {"name": "org/chats", "split": "train", "revision": "", "weight": 1, "label": "org/chats [train]"},
    ]
    flags, _ = train.parse_args(["--datasets", "[{name: a.jsonl, weight: 3}, {name: org/chats, split: train}]"])
    assert flags == cfg
    assert train.fixed_on_resume(json.loads(json.dumps(train.dataclasses.asdict(cfg))), cfg) == {}  # as saved


def bad_line_job(tmp_path, tiny_model_dir, **settings):
    lines = open(SAMPLE).readlines()[:24]
    lines.insert(5, "{not json\n")
    (tmp_path / "data.jsonl").write_text("".join(lines))
    job = {"dataset_name": str(tmp_path / "data.jsonl"), "output_dir": str(tmp_path / "out"), "export": False}
    config = write_tiny_job(tmp_path / "job.yaml", tiny_model_dir, **job, **settings)
    proc = run([*TORCHRUN, "train.py", "--config", str(config)], worker_env(), timeout=180)
    return proc[0], proc[1] + proc[2]


@pytest.mark.distributed
@pytest.mark.parametrize("settings", [{"epochs": 2, "save_every": -1}, {"max_steps": 4, "save_every": -1}])
def test_a_bad_line_is_said_once_by_the_rank_that_reads_it(settings, tiny_model_dir, tmp_path):
    """Two ranks, two epochs (or no counting pass): the line is said in the counting pass or the first pass only."""
    rc, output = bad_line_job(tmp_path, tiny_model_dir, **settings)
    assert rc == 0, output[-3000:]
    assert output.count("line 6 is not UTF-8 JSON: skipped") == 1, output[-3000:]


@pytest.mark.distributed
def test_the_skip_fraction_error_names_the_counts_over_all_ranks_without_a_counting_pass(tiny_model_dir, tmp_path):
    """Rank 1 reads only records without an assistant turn; rank 0 none: the error, raised at a log line on every
    rank, gives the reasons over all ranks (they add up to the skipped count), not rank 0's."""
    good, bad = json.loads(open(SAMPLE).readline()), {"messages": [{"role": "user", "content": "anyone?"}]}
    (tmp_path / "half.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [good, bad] * 20))
    job = {"dataset_name": str(tmp_path / "half.jsonl"), "output_dir": str(tmp_path / "out"), "max_steps": 3}
    config = write_tiny_job(tmp_path / "job.yaml", tiny_model_dir, **job, log_every=1, save_every=-1)
    rc, out, err = run([*TORCHRUN, "train.py", "--config", str(config)], worker_env(), timeout=180)
    found = re.search(r"(\d+) of (\d+) records cannot be trained on .*: \{'no assistant turn': (\d+)\}", err)
    assert rc != 0 and found, (out + err)[-3000:]
    assert found[1] == found[3] and int(found[1]) > 0 and "on this rank" not in err


def test_a_parquet_file_of_mixed_forms_reads_each_record_by_its_non_null_keys(tokenizer, tmp_path):
    """Parquet gives every row every column, null where a form has none: the form comes from the keys with values."""
    from datasets import Dataset

    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    sharegpt = [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]
    rows = [{"messages": chat, "conversations": None, "text": None}]
    rows += [{"messages": None, "conversations": sharegpt, "text": None}]
    rows += [{"messages": None, "conversations": None, "text": "Once upon a time."}]
    Dataset.from_list(rows).to_parquet(tmp_path / "mixed.parquet")
    cfg = train.Config(dataset_name=str(tmp_path / "mixed.parquet"), max_seq_len=256)
    counts = list(train.PackedBlocks(cfg, tokenizer, "train", 0, 1, epochs=1))[-1]["position"].counts_at_end
    assert counts["conversations"] == 3 and train.skip_reasons(counts) == {}


def test_a_mixtures_step_count_counts_each_epoch_which_draws_its_mix_anew(tmp_path, tiny_model_dir, tokenizer):
    """Several sources: each epoch draws its mix anew, so the second packs into other blocks than the first (here 31
    against 25). The counting pass packs every epoch: the run plans and trains each block once, its schedule ends
    where its data does. (Counting epoch 1 only planned 2 x 25 steps and left 6 blocks untrained.)"""
    lines = SAMPLE.read_text().splitlines()
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:40]) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(lines[100:120]) + "\n")
    sources = [{"name": str(tmp_path / "a.jsonl")}, {"name": str(tmp_path / "b.jsonl")}]
    settings = dict(datasets=sources, max_seq_len=2048, pack_buffer_blocks=4, epochs=2, seed=1, save_every=-1)
    cfg = train.Config(**{**settings, "datasets": tuple(sources)})
    epochs = Counter(b["position"].epoch for b in train.PackedBlocks(cfg, tokenizer, "train", 0, 1, epochs=2))
    blocks = epochs[0] + epochs[1]  # each epoch's blocks (its stream's end, a blockless item, is epoch 2's)
    assert epochs[0] != epochs[1], epochs
    job = write_tiny_job(
        tmp_path / "job.yaml", tiny_model_dir, **settings, export=False, output_dir=str(tmp_path / "o")
    )
    result = train.train(str(job))
    records = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    trained = next(r["data_seen"]["blocks"] for r in records if "data_seen" in r)
    assert result["steps"] == trained == blocks and records[-2]["total_steps"] == blocks, (result, records[-2])


def test_a_hub_dataset_whose_name_has_a_dot_is_read_from_the_hub_not_as_a_file():
    """Only .jsonl, .json and .parquet names are local files: teknium/OpenHermes-2.5 is a hub dataset's."""
    cfg = train.Config(dataset_name="teknium/OpenHermes-2.5", dataset_split="train", dataset_revision="")
    assert train.data_sources(cfg, "train")[0]["label"] == "teknium/OpenHermes-2.5 [train]"
    held_out = train.Config(dataset_name="org/chats-v1.1", dataset_revision="", eval_split="test.v2")
    assert train.data_sources(held_out, "eval")[0] | {"label": ""} == {
        "name": "org/chats-v1.1",
        "split": "test.v2",
        "revision": "",
        "weight": 1,
        "label": "",
    }
    with pytest.raises(train.UserError, match="with datasets, eval_split must be a local file"):
        train.Config(datasets=({"name": "a.jsonl"},), eval_split="test.v2")


@pytest.mark.parametrize("files", [1, 2])
def test_a_datasets_source_is_read_whole_by_each_data_worker_which_takes_its_own_share(tokenizer, tmp_path, files):
    """datasets' streaming dataset, iterated in a DataLoader worker, reads only that worker's files; read_records
    shards the records itself, so each worker must read them all. A .parquet file, and a folder of two read the hub's
    way, train every record once with 2 workers, as with none, and never a held-out one."""
    from datasets import Dataset

    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:48]]
    name = tmp_path / ("data.parquet" if files == 1 else "hub")
    if files == 1:
        Dataset.from_list(rows).to_parquet(name)
    for k in range(files if files > 1 else 0):
        Dataset.from_list(rows[k::files]).to_parquet(tmp_path / f"hub/part-{k}.parquet")
    settings = dict(dataset_name=str(name), dataset_split="train", dataset_revision="", eval_fraction=0.25)

    def conversations(part, num_workers):  # each segment's tokens, over the blocks of rank 0 of 1
        cfg = train.Config(**settings, max_seq_len=2048, pack_buffer_blocks=2, num_workers=num_workers)
        seen = Counter()
        for block in train.block_loader(cfg, tokenizer, part, 0, 1, epochs=1):
            bounds = block["cu_seqlens"].tolist() if "input_ids" in block else []
            seen.update(
                tuple(block["input_ids"][0, a:b].tolist()) for a, b in zip(bounds, bounds[1:]) if a < block["tokens"]
            )
        return seen

    alone, held_out = conversations("train", 0), conversations("eval", 0)
    assert sum(alone.values()) + sum(held_out.values()) == 48 and set(alone).isdisjoint(held_out) and held_out
    assert conversations("train", 2) == alone


def test_a_record_held_out_of_one_source_is_held_out_of_another_that_holds_it_too(two_sources):
    """One split listed at two revisions (here one file twice) holds the same records at the same places: a record
    held out of one must not be trained through the other."""
    twice = (two_sources[0], {**two_sources[0], "revision": "v2", "weight": 1})
    held = train.Config(datasets=twice, eval_fraction=0.3)
    trained, held_out = {t for _, t, _ in stream(held)}, {t for _, t, _ in stream(held, "eval")}
    assert trained and held_out and not trained & held_out
