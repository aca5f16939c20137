"""tools/simulate_memory.py: waste, pool runs and prefix sharing on tiny traces computed by hand."""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _load_model() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kv_memory_model", TOOLS / "kv_memory_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kv_memory_model"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


m = _load_model()
R = m.Request


def test_static_waste_by_hand() -> None:
    # final lengths 15 and 32 in slots of 64: (49 + 32) / 128 unused; paged: 1 + 0 of 16 + 32
    cont, paged = m.static_waste([R(10, 5), R(20, 12)], 64, 16)
    assert cont == pytest.approx(81 / 128)
    assert paged == pytest.approx(1 / 48)


def test_contiguous_pool_by_hand() -> None:
    # 2 slots of 32: A and B run, B ends after step 2, C takes its slot in step 3
    s = m.simulate_pool([R(10, 3), R(20, 2), R(5, 1)], pool_tokens=64, max_model_len=32,
                        block_size=16)
    assert s.running_per_step == [2, 2, 2]
    assert s.waste == pytest.approx(1 - (32 + 34 + 19) / (3 * 64))
    assert (s.num_steps, s.mean_running, s.peak_running, s.num_preemptions) == (3, 2.0, 2, 0)


def test_paged_pool_by_hand() -> None:
    # 4 blocks of 16: A takes 1, B 2, C 1, so all three run at once
    s = m.simulate_pool([R(10, 3), R(20, 2), R(5, 1)], pool_tokens=64, block_size=16)
    assert s.running_per_step == [3, 2, 1]
    assert s.waste == pytest.approx(1 - (38 + 34 + 13) / (64 + 48 + 16))
    assert s.num_preemptions == 0 and s.mean_running == 3.0


def test_paged_preempts_the_latest_admitted() -> None:
    # 2 blocks of 4: A needs a second block in step 2, B (latest) is preempted with 4 tokens and
    # readmitted once A finishes, needing 2 blocks for prompt + 1 generated + the next token
    s = m.simulate_pool([R(3, 3), R(3, 3)], pool_tokens=8, block_size=4)
    assert s.running_per_step == [2, 1, 1, 1, 1]
    assert (s.num_preemptions, s.num_recomputed_tokens) == (1, 4)
    assert s.waste == pytest.approx(1 - (8 + 5 + 6 + 5 + 6) / 40)
    assert s.mean_running == 1.0


def test_paged_request_preempts_itself_when_it_is_the_latest() -> None:
    s = m.simulate_pool([R(2, 2), R(3, 2)], pool_tokens=8, block_size=4)
    assert s.running_per_step == [2, 1, 1]
    assert (s.num_preemptions, s.num_recomputed_tokens) == (1, 4)
    assert s.waste == pytest.approx(1 - (7 + 4 + 5) / (8 + 4 + 8))


def test_pool_too_small_is_refused() -> None:
    with pytest.raises(ValueError, match="pool_tokens 16"):
        m.simulate_pool([R(10, 10)], pool_tokens=16, max_model_len=32)
    with pytest.raises(ValueError, match="pool_tokens 16"):
        m.simulate_pool([R(10, 10)], pool_tokens=16, block_size=16)
    with pytest.raises(ValueError, match="max_model_len 16"):
        m.simulate_pool([R(10, 10)], pool_tokens=64, max_model_len=16)


def test_prefix_sharing_blocks_by_hand() -> None:
    # 40-token prompt: 2 full blocks shared, its last 8 tokens stay with each conversation
    assert m.prefix_sharing_blocks([5, 30], 40, 16) == (3 + 5, 2 + 1 + 3)


def test_clip_to_max_len() -> None:
    kept, rejected = m.clip_to_max_len([R(3000, 10), R(2000, 100), R(10, 10)], 2048)
    assert kept == [R(2000, 48), R(10, 10)] and rejected == 1


def test_trace_matches_its_lognormal_parameters() -> None:
    trace = m.sharegpt_like_trace(100_000, seed=3)
    prompts = np.array([r.prompt_len for r in trace])
    outputs = np.array([r.output_len for r in trace])
    assert prompts.mean() == pytest.approx(m.PROMPT_MEAN, rel=0.03)
    assert np.median(prompts) == pytest.approx(m.PROMPT_MEDIAN, rel=0.03)
    assert outputs.mean() == pytest.approx(m.OUTPUT_MEAN, rel=0.03)
    assert np.median(outputs) == pytest.approx(m.OUTPUT_MEDIAN, rel=0.03)
    assert m.sharegpt_like_trace(1000, seed=3) == m.sharegpt_like_trace(1000, seed=3)
    assert m.sharegpt_like_trace(1000, seed=3) != m.sharegpt_like_trace(1000, seed=4)


def test_tool_writes_only_its_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(TOOLS))
    tool = runpy.run_path(str(TOOLS / "simulate_memory.py"))
    bench = tmp_path / "benchmarks.md"
    bench.write_text("# kvcore benchmarks\n\n## Block pool\n\nother numbers\n")
    argv = ["--requests", "60", "--conversations", "50", "--pool", "256MiB", "--plot",
            str(tmp_path / "sim.png"), "--update-benchmarks", str(bench)]
    assert tool["main"](argv) == 0
    assert tool["main"](argv) == 0  # a rerun replaces the section instead of adding one
    text = bench.read_text()
    assert text.count(tool["SECTION"]) == 1 and "## Block pool\n\nother numbers" in text
    assert "| 2,048 |" in text and "| 8,192 |" in text and "prefix sharing" in text
    assert (tmp_path / "sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "the 60-80% claim is" in capsys.readouterr().out
