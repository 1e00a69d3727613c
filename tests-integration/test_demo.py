"""demo/run_demo.py --quick runs end to end from the source tree: both stacks train, the loss
checks pass (exit 0), and the plot and the numbers are written."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 240  # --quick takes about 20 s on 2 idle cores; a shared machine is slower


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="the demo's plot needs matplotlib"
)
def test_demo_quick(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in sorted(REPO.glob("packages/*/src")))
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, whatever the machine has
    done = subprocess.run(
        [sys.executable, str(REPO / "demo" / "run_demo.py"), "--quick", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "DEMO PASSED" in done.stdout
    assert (out / "demo.png").stat().st_size > 10_000
    results = json.loads((out / "results.json").read_text())
    for part, key in [("gpt", "tokens_per_s"), ("cnn", "images_per_s")]:
        for stack in ("apex", "torch"):
            assert results[part][stack][key] > 0, (part, stack)
        assert results[part]["speed_ratio_apex_over_torch"] > 0, part
