"""The device check script runs on a machine without a GPU in its dry mode: its shell, its imports
and the ops part's arguments (`PART=bench` / `tp` in DRY mode take minutes on the CPU: run by hand,
docs/ops.md)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_parts_run_on_the_cpu(tmp_path):
    env = {**os.environ, "DRY": "1", "PART": "env,ops", "OUT": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                         timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "done:" in out.stdout and (tmp_path / "env.txt").read_text().startswith("torch ")
    assert "imports and arguments checked" in (tmp_path / "ops.log").read_text()
