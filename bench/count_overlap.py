#!/usr/bin/env python3
"""Launch to the model line on CPU (issue 25, target 5): train.py counts DATA (the counting pass) and fetches
MODEL_DIR's weights from a stand-in hub (tests/fake_hub.py) at RATE bytes/s, as a real job fetches them from the
hub or reads them from a volume. Prints the seconds from launch to the data line and to the model line, and the
data line's own timing. With --train-py an older train.py, the same runs for comparison.

    python bench/count_overlap.py MODEL_DIR DATA [--rate 1e6] [--train-py train.py] [--repeats 3]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from fake_hub import FakeHub  # noqa: E402


def launch_to_model_line(train_py: Path, model_dir: Path, data: Path, rate: float) -> tuple[float, float, str]:
    hub = FakeHub(model_dir, "bench/model", bytes_per_s=rate)
    with tempfile.TemporaryDirectory() as tmp:
        job = {"model_name": "bench/model", "model_revision": "", "dataset_name": str(data), "max_seq_len": 1024}
        job |= {"compile": False, "attn_implementation": "sdpa", "output_dir": f"{tmp}/out", "export": False}
        Path(tmp, "job.yaml").write_text(yaml.safe_dump(job))
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": f"{tmp}/hf", "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1"}
        command = [sys.executable, str(train_py), "--config", f"{tmp}/job.yaml"]
        t0, counted, timing, seen = time.monotonic(), None, "", []
        proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("data: {"):
                counted, timing = time.monotonic() - t0, re.search(r"\(counted in [^)]*\)", line)[0]
            if line.startswith("model: "):
                break
        built = time.monotonic() - t0
        proc.kill(), proc.wait(), hub.close()
    if counted is None:
        sys.exit(f"{train_py} gave no data line:\n{''.join(seen[-20:])}")
    return counted, built, timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("data", type=Path)
    parser.add_argument("--rate", type=float, default=1e6)
    parser.add_argument("--train-py", type=Path, default=ROOT / "train.py")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size = sum(p.stat().st_size for p in args.model_dir.glob("*.safetensors"))
    records = sum(1 for line in open(args.data) if line.strip())
    print(f"{args.train_py}: {records} records; weights {size / 1e6:.1f} MB at {args.rate / 1e6:.2f} MB/s", flush=True)
    for _ in range(args.repeats):
        counted, built, timing = launch_to_model_line(args.train_py.resolve(), args.model_dir, args.data, args.rate)
        print(f"data line {counted:.1f} s {timing}, model line {built:.1f} s after launch", flush=True)


if __name__ == "__main__":
    main()
