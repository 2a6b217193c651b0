"""`python -m kiln.layers.kernels` (make install): builds every level this CPU runs, compiles
the others without loading them, and prints which level kiln will run."""

from __future__ import annotations

import logging

from kiln.layers import kernels
from kiln.layers.kernels.build import compile_only, library
from kiln.layers.kernels.isa import LEVELS, cpu_runs

logging.basicConfig(level=logging.INFO, format="%(message)s")
for lv in LEVELS:
    why = cpu_runs(lv)
    if why is None:
        print(f"kiln {lv.name} kernels:", "on" if library(lv.name) else "failed (see above)")
    else:
        ok, err = compile_only(lv.name)
        print(f"kiln {lv.name} kernels: compiled only ({why})" if ok
              else f"kiln {lv.name} kernels: DO NOT COMPILE: {err}")
print("kiln runs:", kernels.level() or "PyTorch's paths", f"({kernels.reason()})")
