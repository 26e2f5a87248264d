"""A model named by its hub id, from a stand-in hub over HTTP (tests/fake_hub.py): train.py's real download path
(snapshot_download, safetensors only), and its weights downloading while the counting pass runs."""

import os
import subprocess
import sys
import time

from conftest import ROOT, worker_env, write_tiny_job
from fake_hub import FakeHub


def test_a_hub_models_weights_download_while_the_data_is_counted(tiny_model_dir, tmp_path):
    hub = FakeHub(tiny_model_dir, "tiny-org/tiny-chat", bytes_per_s=1e6)  # its 1.3 MB of weights take about 1.3 s
    job = write_tiny_job(tmp_path / "job.yaml", tiny_model_dir, model_name="tiny-org/tiny-chat", num_workers=1)
    env = worker_env(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1")
    command = [sys.executable, "train.py", "--config", str(job), "--output_dir", str(tmp_path / "out")]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []  # (time read, line): the counting pass ends with its data line; the model line follows the load
    try:
        for line in proc.stdout:
            lines.append((time.monotonic(), line))
            if "model: " in line:  # (tqdm's download bars share lines: \r, no newline)
                break
    finally:
        proc.kill()
        proc.wait()
        hub.close()
    output = "".join(line for _, line in lines)
    counted = next((t for t, line in lines if "data: {" in line), None)
    assert counted and "pretrained weights" in lines[-1][1], output[-3000:]
    weights = [(start, end) for method, path, start, end in hub.requests if method == "GET" and "safetensors" in path]
    assert len(weights) == 1 and weights[0][0] < counted, (weights, counted)  # begun before the count ended
    snapshot = next((tmp_path / "hf/hub/models--tiny-org--tiny-chat/snapshots").iterdir())
    assert (snapshot / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    assert not [p for p in os.listdir(snapshot) if p.endswith((".bin", ".pt"))]
