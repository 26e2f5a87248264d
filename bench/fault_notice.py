"""How soon a rank learns that its peer died (README, "Faults mid-run"): 2 CPU ranks under torchrun train the tiny model
(tests/test_checkpoint.py's resume job, 64 bundled conversations), rank 1 SIGKILLs itself in step 5 of each attempt
(tests/workers/fault_worker.py's kill-rank1-at-5), and torchrun restarts it once. Prints, per attempt, the seconds
from the last step line before the kill to rank 0's error, and the whole run's wall time.

    python bench/fault_notice.py TINY_MODEL_DIR     # the model: python tools/make_tiny_model.py TINY_MODEL_DIR
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
from conftest import SAMPLE, TORCHRUN, WORKERS, job, worker_env  # noqa: E402


def main() -> None:
    model = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "data.jsonl").write_text("".join(open(SAMPLE).readlines()[:64]))
        job(tmp, model, "failing", tmp / "data.jsonl", log_every=1)
        command = [*TORCHRUN, "--max-restarts=1", str(WORKERS / "fault_worker.py"), str(tmp / "failing.yaml")]
        t0, last_step = time.monotonic(), None
        proc = subprocess.Popen(
            [*command, "kill-rank1-at-5"], cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for line in proc.stdout:
            line = line.decode(errors="replace")
            if line.startswith("step "):
                last_step = time.monotonic()
            elif line.startswith("rank 0: ") and last_step is not None:
                print(f"rank 0's error {time.monotonic() - last_step:.1f} s after the last step line")
                last_step = None
        proc.wait()
        print(f"exit status {proc.returncode}, {time.monotonic() - t0:.1f} s in all")


if __name__ == "__main__":
    main()
