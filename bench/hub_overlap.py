#!/usr/bin/env python3
"""Launch to the model line (weights downloaded, model built) for a model named by its hub id, on CPU: train.py
serves MODEL_DIR from a stand-in hub (tests/fake_hub.py) at RATE bytes/s and counts DATA first (issue 25, target 5).
With TRAIN_PY an older train.py, the same run for comparison. Prints the seconds to the data and model lines.

    python bench/hub_overlap.py MODEL_DIR DATA [--rate 1e6] [--train-py train.py] [--repeats 3]
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from fake_hub import FakeHub  # noqa: E402


def launch_to_model_line(train_py: Path, model_dir: Path, data: Path, rate: float) -> tuple[float, float]:
    hub = FakeHub(model_dir, "bench/model", bytes_per_s=rate)
    with tempfile.TemporaryDirectory() as tmp:
        job = {"model_name": "bench/model", "dataset_name": str(data), "max_seq_len": 1024, "compile": False}
        job |= {"attn_implementation": "sdpa", "output_dir": f"{tmp}/out", "export": False}
        Path(tmp, "job.yaml").write_text(yaml.safe_dump(job))
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": f"{tmp}/hf", "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1"}
        command = [sys.executable, str(train_py), "--config", f"{tmp}/job.yaml"]
        t0, counted = time.monotonic(), None
        proc = subprocess.Popen(command, cwd=ROOT, env={**__import__("os").environ, **env}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        for line in proc.stdout:
            counted = counted or ("data: {" in line and time.monotonic() - t0)
            if "model: " in line:
                break
        built = time.monotonic() - t0
        proc.kill(), proc.wait(), hub.close()
    return counted, built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("data", type=Path)
    parser.add_argument("--rate", type=float, default=1e6)
    parser.add_argument("--train-py", type=Path, default=ROOT / "train.py")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size = sum(p.stat().st_size for p in args.model_dir.glob("*.safetensors"))
    print(f"{args.train_py}: weights {size / 1e6:.1f} MB at {args.rate / 1e6:.1f} MB/s ({size / args.rate:.1f} s)")
    for _ in range(args.repeats):
        counted, built = launch_to_model_line(args.train_py.resolve(), args.model_dir, args.data, args.rate)
        print(f"data line {counted:.1f} s, model line {built:.1f} s after launch", flush=True)


if __name__ == "__main__":
    main()
