import dataclasses
import math
import subprocess
import sys

import pytest
from conftest import ROOT

import train


def write(path, text):
    path.write_text(text)
    return str(path)


def test_defaults_are_the_seed_job():
    cfg = train.Config()
    assert (cfg.model_name, cfg.dataset_name, cfg.dataset_split) == (
        "Qwen/Qwen3.8-27B",
        "HuggingFaceH4/ultrachat_200k",
        "train_sft",
    )
    assert (cfg.max_seq_len, cfg.learning_rate, cfg.adam_beta1, cfg.adam_beta2) == (32768, 1e-5, 0.9, 0.95)
    assert (cfg.weight_decay, cfg.epochs) == (0.0, 1)


def test_precedence_parameters_then_config_file_then_flags(tmp_path, monkeypatch):
    params = write(tmp_path / "params.yaml", "learning_rate: 0.001\nmax_steps: 5\nseed: 3\n")
    config = write(tmp_path / "job.yaml", "max_steps: 7\nseed: 4\n")
    monkeypatch.setenv("HYPERPARAMETERS_PATH", params)
    cfg, _ = train.parse_args(["--config", config, "--seed", "9"])
    assert (cfg.learning_rate, cfg.max_steps, cfg.seed) == (0.001, 7, 9)
    cfg, _ = train.parse_args(["--seed=11", "--config", config])  # flags win wherever they stand
    assert cfg.seed == 11


def test_flag_values_are_typed(monkeypatch):
    monkeypatch.delenv("HYPERPARAMETERS_PATH", raising=False)
    cfg, _ = train.parse_args(["--learning_rate", "2e-5", "--compile", "true", "--model_revision", "1.0"])
    assert cfg.learning_rate == 2e-5 and cfg.compile is True and cfg.model_revision == "1.0"  # str stays str


def test_the_default_revisions_pin_only_the_default_repos(tmp_path, monkeypatch):
    """The default revisions are commits of Qwen/Qwen3.8-27B and UltraChat: another model or dataset named without a
    revision is read at its latest, not asked for at a commit it does not have; a revision given is kept."""
    monkeypatch.setenv("HYPERPARAMETERS_PATH", write(tmp_path / "p.yaml", "model_name: Qwen/Qwen3-8B\n"))
    default, other = train.Config(), train.parse_args(["--dataset_name", "org/chats"])[0]
    assert len(default.model_revision) == len(default.dataset_revision) == 40  # the default job stays pinned
    assert (other.model_name, other.model_revision, other.dataset_revision) == ("Qwen/Qwen3-8B", "", "")
    pinned = train.Config(model_name="Qwen/Qwen3-8B", model_revision="abc", dataset_name="org/chats")
    assert (pinned.model_revision, pinned.dataset_revision) == ("abc", "")
    mixed = train.Config(datasets=({"name": "org/chats"},))  # the dataset_* fields unset: no conflict
    assert mixed.dataset_revision == default.dataset_revision and mixed.model_revision == default.model_revision


def test_yaml_exponent_without_dot_is_a_float(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERPARAMETERS_PATH", write(tmp_path / "p.yaml", "learning_rate: 1e-5\n"))
    assert train.parse_args([])[0].learning_rate == 1e-5


def test_int_is_accepted_for_a_float_field(monkeypatch):
    monkeypatch.delenv("HYPERPARAMETERS_PATH", raising=False)
    cfg, _ = train.parse_args(["--max_grad_norm", "2"])
    assert cfg.max_grad_norm == 2.0 and isinstance(cfg.max_grad_norm, float)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--learning_rat", "1e-5"], "key 'learning_rat' (from command line); did you mean 'learning_rate'?"),
        (["--max_steps", "ten"], "'max_steps' (from command line) must be int"),
        (["--epochs", "1.5"], "'epochs' (from command line) must be int"),
        (["--compile", "maybe"], "'compile' (from command line) must be bool"),
        (["--activation_checkpointing", "true"], "activation_checkpointing must be auto, or a share in [0, 1]"),
        (["--activation_checkpointing", "nan"], "activation_checkpointing must be auto, or a share in [0, 1]"),
    ],
)
def test_bad_flags_name_the_key(args, message, monkeypatch):
    monkeypatch.delenv("HYPERPARAMETERS_PATH", raising=False)
    with pytest.raises(ValueError) as err:
        train.parse_args(args)
    assert message in str(err.value)


def test_bad_parameters_file_names_the_key_and_the_file(tmp_path, monkeypatch):
    params = write(tmp_path / "params.yaml", "per_device_batch_size: 4\n")
    monkeypatch.setenv("HYPERPARAMETERS_PATH", params)
    with pytest.raises(ValueError, match=r"unknown configuration key 'per_device_batch_size' \(from HYPERPARAMETERS"):
        train.parse_args([])


def test_train_rejects_unknown_keys_before_loading_anything():
    with pytest.raises(ValueError, match="unknown configuration key 'lr'"):
        train.train({"lr": 1e-4})


@pytest.mark.parametrize(
    "override, message",
    [
        ({"lr_schedule": "exp"}, "lr_schedule"),
        ({"attn_implementation": "flash3"}, "attn_implementation"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"activation_checkpointing": 1.5}, "activation_checkpointing"),
        ({"activation_checkpointing": "some"}, "activation_checkpointing"),
    ],
)
def test_settings_that_cannot_work_fail_validation(override, message):
    with pytest.raises(ValueError, match=message):
        train.Config(**override)


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = train.Config(warmup_steps=4, min_lr_ratio=0.1, lr_schedule="cosine")
    factors = [train.lr_factor(s, cfg, 20) for s in range(20)]
    assert factors[:4] == [0.2, 0.4, 0.6, 0.8] and factors[4] == 1.0
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert train.lr_factor(20, cfg, 20) == pytest.approx(0.1)
    # The cosine at a quarter of the decay (step 8: 4 of 16 steps), not a straight line: 0.868 where linear is 0.775.
    assert train.lr_factor(8, cfg, 20) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), abs=1e-12)
    assert train.lr_factor(16, cfg, 20) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.75)), abs=1e-12)
    linear = train.Config(warmup_steps=0, min_lr_ratio=0.0, lr_schedule="linear")
    assert [train.lr_factor(s, linear, 10) for s in (0, 5, 8)] == pytest.approx([1.0, 0.5, 0.2], abs=1e-12)
    constant = train.Config(warmup_steps=2, lr_schedule="constant")
    assert [train.lr_factor(s, constant, 10) for s in (0, 1, 2, 9)] == pytest.approx([1 / 3, 2 / 3, 1, 1], abs=1e-12)


def test_a_config_built_in_code_is_checked_like_one_from_a_file():
    with pytest.raises(ValueError, match="max_seq_len must be >= 16, got 8"):
        train.Config(max_seq_len=8)
    with pytest.raises(ValueError, match="'epochs' \\(from Config\\) must be int"):
        train.Config(epochs="2")
    assert train.Config(max_grad_norm=2).max_grad_norm == 2.0


def test_a_setting_may_change_on_resume_only_if_its_field_says_so():
    saved = dataclasses.asdict(train.Config())
    free = train.Config(log_every=1, max_steps=9, output_dir="elsewhere", activation_checkpointing=0.5)
    assert train.fixed_on_resume(saved, free) == {}
    fixed = train.Config(seed=1, num_workers=0, learning_rate=2e-5)
    assert train.fixed_on_resume(saved, fixed) == {"seed": (0, 1), "num_workers": (1, 0), "learning_rate": (1e-5, 2e-5)}
    resumable = {f.name for f in dataclasses.fields(train.Config) if f.metadata["resumable"]}
    # Exactly these: none changes the blocks, their order, the held-out records, the step's batch or the optimizer
    kernels = {"attn_implementation", "param_dtype", "reduce_dtype", "activation_checkpointing", "compile", "float8"}
    saves = {"async_save", "save_every", "save_every_minutes", "keep_checkpoints", "export", "output_dir"}
    cadence = {"log_every", "eval_every", "eval_blocks", "eval_split", "loss_chunk_tokens", "collective_timeout_s"}
    limits = {"max_steps", "max_grad_norm", "max_bad_steps", "max_skip_fraction", "trust_remote_code"}
    assert resumable == kernels | saves | cadence | limits
    # What decides the tokens, and so what a checkpoint's data positions point at, is fixed.
    tokens = {"model_name", "model_revision", "tokenizer_name", "dataset_name", "dataset_revision", "max_seq_len"}
    assert not tokens & resumable


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_setting_from_its_field(flag):
    proc = subprocess.run([sys.executable, "train.py", flag], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps the help to the terminal's width
    for f in dataclasses.fields(train.Config):
        assert f"--{f.name} {type(f.default).__name__.upper()} {f.metadata['doc']}" in text, f.name
    assert "tokens per packed block (default: 32768; >= 16)" in text  # the check's bound, from check_settings
    assert "steps per log line (also logged at every checkpoint) (default: 10; >= 1; may change on resume)" in text
    assert "(default: 'auto'; one of auto, flash_attention_2, torch_varlen, sdpa, eager; may change on resume)" in text


def test_activation_checkpointing_is_auto_or_a_share_from_any_source(tmp_path, monkeypatch):
    """YAML reads 0.75 as a number, a flag as a string; both mean the same share."""
    monkeypatch.delenv("HYPERPARAMETERS_PATH", raising=False)
    (tmp_path / "job.yaml").write_text("activation_checkpointing: 0.75\n")
    from_file, _ = train.parse_args(["--config", str(tmp_path / "job.yaml")])
    from_flag, _ = train.parse_args(["--activation_checkpointing", "0.75"])
    assert train.recompute_share(from_file.activation_checkpointing) == 0.75
    assert train.recompute_share(from_flag.activation_checkpointing) == 0.75
    assert train.recompute_share(train.Config().activation_checkpointing) is None  # auto, the default


def test_auto_recompute_keeps_the_most_time_saved_per_byte_that_fits():
    gib = 2**30
    sizes = [7 * gib, 8 * gib, 7 * gib, 8 * gib]  # e.g. Gated DeltaNet, attention, Gated DeltaNet, attention
    seconds = [0.040, 0.060, 0.041, 0.050]  # per byte: layer 1 first, then 3, 2, 0
    assert train.parts_to_keep(sizes, seconds, room=16 * gib) == [1, 3]
    assert train.parts_to_keep(sizes, seconds, room=15.5 * gib) == [1, 2]  # 3 does not fit after 1; 2 does
    assert train.parts_to_keep(sizes, seconds, room=100 * gib) == [1, 3, 2, 0]  # in that order
    assert train.parts_to_keep(sizes, seconds, room=-gib) == []  # the first step's peak already too close
    assert train.parts_to_keep(sizes, seconds, room=100 * gib, kept=[3, 2]) == [1, 0]  # beside those kept


@pytest.mark.parametrize("text, value", [('"no"', False), ("'On'", True), ('"yes"', True), ('"FALSE"', False)])
def test_a_boolean_written_as_yaml_1_1_words_is_read_from_a_string_too(tmp_path, monkeypatch, text, value):
    """databricks air reads the workload YAML as YAML 1.2 (Go's yaml.v3), where no, off, yes and on are strings:
    its parameters reach $HYPERPARAMETERS_PATH as strings, which a bool setting reads as YAML 1.1 would."""
    monkeypatch.setenv("HYPERPARAMETERS_PATH", write(tmp_path / "p.yaml", f"async_save: {text}\nexport: {text}\n"))
    cfg = train.parse_args([])[0]
    assert cfg.async_save is value and cfg.export is value
    monkeypatch.setenv("HYPERPARAMETERS_PATH", write(tmp_path / "q.yaml", 'async_save: "maybe"\n'))
    with pytest.raises(ValueError, match="'async_save' \\(from HYPERPARAMETERS_PATH .*\\) must be bool, got 'maybe'"):
        train.parse_args([])


@pytest.mark.parametrize("text", ["0123456", "1.10", "1_000"])
def test_a_revision_that_yaml_reads_as_a_number_is_refused_and_a_quoted_one_kept(tmp_path, monkeypatch, text):
    """Unquoted, YAML reads 0123456 as an octal 42798, 1.10 as 1.1 and 1_000 as 1000: the text is gone."""
    monkeypatch.setenv("HYPERPARAMETERS_PATH", write(tmp_path / "p.yaml", f"model_revision: {text}\n"))
    with pytest.raises(
        ValueError, match="'model_revision' \\(from HYPERPARAMETERS_PATH .*\\) must be str \\(quoted: YAML read this"
    ):
        train.parse_args([])
    monkeypatch.setenv("HYPERPARAMETERS_PATH", write(tmp_path / "p.yaml", f'dataset_revision: "{text}"\n'))
    assert train.parse_args([])[0].dataset_revision == text
    assert train.parse_args(["--model_revision", text])[0].model_revision == text  # a flag's string stays a string
