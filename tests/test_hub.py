"""A model named by its hub id, from a stand-in hub over HTTP (tests/fake_hub.py): train.py's real download path
(snapshot_download of the configuration, tokenizer and safetensors files), and a gated repo's one-line error."""

import json
import sys

from conftest import ROOT, run, worker_env, write_tiny_job
from fake_hub import FakeHub


def hub_job(tmp_path, tiny_model_dir, hub: FakeHub, **settings) -> tuple[int, str, str]:
    job = write_tiny_job(tmp_path / "job.yaml", tiny_model_dir, model_name=hub.repo, output_dir=str(tmp_path / "out"))
    env = worker_env(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1", HF_TOKEN="")
    flags = [f"--{key}={value}" for key, value in settings.items()]
    try:
        return run([sys.executable, str(ROOT / "train.py"), "--config", str(job), *flags], env, timeout=180)
    finally:
        hub.close()


def test_a_hub_model_downloads_its_safetensors_and_trains(tiny_model_dir, tmp_path):
    hub = FakeHub(tiny_model_dir, "tiny-org/tiny-chat")
    rc, out, err = hub_job(tmp_path, tiny_model_dir, hub, max_steps=2, save_every=-1)
    assert rc == 0 and "pretrained weights" in out and "step 2/2" in out, err[-3000:]
    snapshot = next((tmp_path / "hf/hub/models--tiny-org--tiny-chat/snapshots").iterdir())
    assert (snapshot / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    got = [path.rsplit("/", 1)[1] for method, path, *_ in hub.requests if method == "GET" and "/resolve/" in path]
    assert got.count("model.safetensors") == 1 and "config.json" in got, got
    exported = json.loads((tmp_path / "out/model/config.json").read_text())
    assert exported["model_type"] == json.loads((tiny_model_dir / "config.json").read_text())["model_type"]


def test_a_gated_hub_model_without_a_token_is_one_line_saying_what_to_do(tiny_model_dir, tmp_path):
    rc, out, err = hub_job(tmp_path, tiny_model_dir, FakeHub(tiny_model_dir, "org/gated", gated=True), max_steps=2)
    assert rc == 2 and "Traceback" not in out + err, err[-3000:]
    assert err.strip().startswith("error: org/gated is gated or private and HF_TOKEN is not set: accept its license")
