#!/usr/bin/env python3
"""The phases of a run's start from a log whose lines bench/first_step.sh prefixed with the milliseconds since launch:
startup (imports, checks, tokenizer) to the configuration line, the model built and its weights ready, steps 1 and
2 logged, and the seconds Triton spent autotuning (its TRITON_PRINT_AUTOTUNING lines), in one line.

    python3 bench/first_step_times.py RUN.log STEPS
"""

import re
import sys
from pathlib import Path


def main(log: str, steps: str) -> None:
    at, autotune, kernels = {}, 0.0, 0
    for line in Path(log).read_text(errors="replace").splitlines():
        ms, _, text = line.partition(" ")
        if not ms.isdigit():
            continue
        for phase, pattern in [
            ("configuration", r"^configuration:"),
            ("model ready", r"^model: "),
            ("step 1", rf"^step 1/{steps} "),
            ("step 2", rf"^step 2/{steps} "),
        ]:
            if phase not in at and re.search(pattern, text):
                at[phase] = int(ms) / 1e3
        if found := re.search(r"finished after ([0-9.]+)s", text):
            autotune, kernels = autotune + float(found[1]), kernels + 1
    phases = " | ".join(f"{phase} {seconds:.1f} s" for phase, seconds in at.items())
    print(f"{Path(log).stem}: {phases} | Triton autotuning {autotune:.1f} s over {kernels} kernel keys")


if __name__ == "__main__":
    main(*sys.argv[1:])
