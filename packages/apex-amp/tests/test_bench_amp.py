"""bench_amp.py runs end to end (``--smoke``: tiny sizes on the CPU) and writes its tables."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_amp.py"


def have_apex_optim() -> bool:
    try:
        import apex.optimizers  # noqa: F401
    except ImportError:
        return False
    return True


def test_bench_smoke_writes_markdown_and_json(tmp_path):
    if not BENCH.exists():
        pytest.skip("benchmarks/ is not shipped in the sdist")
    spec = importlib.util.spec_from_file_location("bench_amp", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    try:
        assert bench.main(["--out", str(tmp_path), "--smoke"]) == 0
    finally:
        bench.DEVICE = "cuda"
    data = json.loads((tmp_path / "bench_amp.json").read_text())
    assert len(data["training"]) == 1
    cases = [r["case"] for r in data["training"][0]["rows"]]
    assert "amp O2 bf16 + AdamW(fused)" in cases
    assert len(cases) == (8 if have_apex_optim() else 6)
    assert all(r["ms"] > 0 for r in data["training"][0]["rows"] + data["overhead"]["rows"])
    assert "| amp per-step total |" in (tmp_path / "bench_amp.md").read_text()
