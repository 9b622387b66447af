"""Every maintained tool in benchmarks/ starts: it imports (with the project's extras only) and
its arguments parse (`--help` exits 0 and says what it measures). The tools' own runs are tested
where they are cheap (test_result_tools.py, test_serve_faults.py, test_gpu_check.py); this keeps
the rest from rotting unnoticed between their real runs."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
TOOLS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_starts(tool):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / tool), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout and len(out.stdout.splitlines()) > 3, out.stdout
