"""kernels.build: torch's extension builder in specdec's cache, one process at a time, whatever the last one left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

BUILD = """
import sys
from pathlib import Path
from specdec_core.models.kernels import build
module = build("specdec_lock_test", Path(sys.argv[1]), [], "a test extension")
print(module.one())
"""


def build_in_a_process(source: Path, cache: Path, timeout: float) -> str:
    result = subprocess.run([sys.executable, "-c", BUILD, str(source)], env={**os.environ, "SPECDEC_CACHE": str(cache)},
                            capture_output=True, text=True, timeout=timeout, check=True)
    return result.stdout.strip()


def test_a_lock_that_a_killed_build_left_does_not_stall_the_next_start(tmp_path):
    source = tmp_path / "one.cpp"
    source.write_text("#include <pybind11/pybind11.h>\n"
                      "PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) { module.def(\"one\", [] { return 1; }); }\n")
    assert build_in_a_process(source, tmp_path, timeout=600) == "1"
    # What a process killed inside torch's builder leaves: its lock file. Before, the next load waited on it forever.
    (tmp_path / "kernels" / f"specdec_lock_test-torch{torch.__version__}" / "lock").write_text("")
    assert build_in_a_process(source, tmp_path, timeout=120) == "1"
