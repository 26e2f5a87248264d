"""BENCH WORKAROUND (timing only): bench.py's lift_fla_hopper_guard in a process that the bench or a GPU test starts
with train.train (tests/test_gpu.py's compile test), which would otherwise stop at fla's Hopper guard (the startup
check) where no TileLang is installed. Put this folder first on the PYTHONPATH; the guard is lifted once
fla.ops.common.chunk_o is imported, so processes that never import fla pay nothing."""

import importlib.abc
import importlib.machinery
import sys


class LiftFlaHopperGuard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "fla.ops.common.chunk_o":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def lifted(module):
            exec_module(module)
            if module.IS_NVIDIA_HOPPER and module.TRITON_ABOVE_3_4_0 and not module.TRITON_ABOVE_3_7_1:
                module.TRITON_ABOVE_3_7_1 = True

        spec.loader.exec_module = lifted
        return spec


sys.meta_path.insert(0, LiftFlaHopperGuard())
