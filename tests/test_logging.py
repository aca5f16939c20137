"""kvcore's log lines follow the convention for libraries (kvcore.logs): an embedding program
that configures no logging sees none of them, one that configures `logging` sees them there;
the CLI's JSON lines are tests/test_service_cli.py's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROGRAM = """
import sys
{setup}
from kvcore import LLM, SamplingParams
llm = LLM(sys.argv[1], block_size=4, num_blocks=8, max_model_len=32, max_num_seqs=3)
# 3 x 12 tokens in a pool of 8 blocks of 4: the scheduler preempts (an info line) on the way
outs = llm.generate([[t] * 6 for t in (5, 6, 7)], SamplingParams(max_tokens=6, ignore_eos=True))
print("tokens", [len(o.outputs[0].token_ids) for o in outs])
"""


def _run(model_dir: Path, setup: str = "") -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(setup=setup), str(model_dir)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_an_unconfigured_program_gets_no_log_lines(tiny_model_dir: Path) -> None:
    done = _run(tiny_model_dir)
    assert done.stdout == "tokens [6, 6, 6]\n"  # the program's own output only
    assert done.stderr == ""


def test_a_program_that_configures_logging_gets_them_there(tiny_model_dir: Path) -> None:
    done = _run(tiny_model_dir, "import logging; logging.basicConfig(level=logging.INFO, "
                                "format='%(levelname)s %(name)s %(message)s')")
    assert done.stdout == "tokens [6, 6, 6]\n"
    lines = done.stderr.splitlines()
    assert any(line.startswith("INFO kvcore.engine.engine ") and "kv cache pool" in line
               for line in lines), lines
    assert any("preempted" in line for line in lines), lines
    assert all(line.split(" ")[1].startswith("kvcore") for line in lines), lines
