"""The `pdserve` command line at its edges: generate's sampling flags, and what a bad
input answers (a usage error on one line, never a traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.cli import build_parser

SIM = ("--engine", "sim", "--sim-time-scale", "0.001")


def pdserve(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *argv], capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_each_stop_flag_adds_one_string_or_one_token_id():
    """`--stop head` became ('h', 'e', 'a', 'd') and `--stop-token-ids 5` ('5',): the flag
    took the whole tuple type as each value's type, and generate failed every time."""
    argv = ["generate", *SIM, "--prompt", "hi", "--stop", "head", "--stop", "x",
            "--stop-token-ids", "5", "--stop-token-ids", "7"]  # fmt: skip
    args = build_parser(argv).parse_args(argv)
    assert (args.stop, args.stop_token_ids) == (["head", "x"], [5, 7])
    assert (args.max_tokens, args.temperature, args.seed) == (64, 0.0, None)  # the others


def test_generate_stops_at_a_stop_string():
    from pdserve.common.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.model.tokenizer import Tokenizer
    from pdserve.common.sampling import SamplingParams

    tok = Tokenizer.load(None)  # the sim engine's tokenizer, whatever --model says
    engine = LLMEngine(EngineConfig(engine="sim", sim_time_scale=0.001), tokenizer=tok)
    [out] = engine.generate([tok.encode("hi")], SamplingParams(max_tokens=8, temperature=0.0))
    stop = out.text[len(out.text) // 2 :][:4]
    done = pdserve("generate", *SIM, "--prompt", "hi", "--max-tokens", "8", "--stop", "zzzz",
                   "--stop", stop, "--model", "/no/model/used/by/the/sim.gguf")  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == out.text[: out.text.index(stop)] + "\n"


SIM_FLAGS = " ".join(SIM)


@pytest.mark.parametrize(
    "command,code,says",
    [
        ("keygen /nonexistent/dir/k", 1, "No such file or directory: '/nonexistent/dir/k'"),
        ("plan --workload sharegpt --dataset /nonexistent.json --slo ttft=1000", 1,
         "No such file or directory: '/nonexistent.json'"),
        (f"generate {SIM_FLAGS} --prompt x --num-threads -1", 2, "--num-threads must be >= 0"),
        ("generate --prompt x --device foo", 2, "--device: cpu, cuda, cuda:N or cuda:auto"),
        (f"generate {SIM_FLAGS} --prompt x --gpu-offset -1", 2, "--gpu-offset must be >= 0"),
        (f"generate {SIM_FLAGS} --prompt x --prefill-pass-tokens -1", 2, "--prefill-pass-tokens"),
        # shorter than a drop and a registration again: healthy nodes would be killed
        ("up --engine sim --restart-hung-after 2", 2, "--restart-hung-after: 0 (never) or"),
        ("up --engine sim --restart-hung-after -1", 2, "--restart-hung-after: 0 (never) or"),
    ],
)  # fmt: skip
def test_a_bad_input_is_one_line_of_error_not_a_traceback(command, code, says):
    """A missing file (OSError) and flags torch refused later (--num-threads -1, --device
    foo) ended in a traceback; negative --gpu-offset and --prefill-pass-tokens passed."""
    done = pdserve(*command.split())
    assert done.returncode == code and says in done.stderr, done.stderr
    assert done.stderr.startswith(f"pdserve {command.split()[0]}: error: ")
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1
