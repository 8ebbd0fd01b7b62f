"""The `pdserve` console script: one sub-command per process or tool.

Sub-commands import their modules lazily, so `pdserve gateway` never loads torch.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import logging
import os
import sys
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from pdserve.common.config import EngineConfig, GatewayConfig, NodeConfig
from pdserve.common.errors import ConfigError, PdserveError
from pdserve.common.flags import add_config_flag, add_flags, apply_config_file, from_args
from pdserve.common.logs import setup_logging

Command = Callable[[argparse.Namespace], int]


def _generate(args: argparse.Namespace) -> int:
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.model.tokenizer import Tokenizer
    from pdserve.common.sampling import SamplingParams
    from pdserve.up_commands import tokenizer_model

    cfg = from_args(EngineConfig, args)
    engine = LLMEngine(cfg, tokenizer=Tokenizer.load(tokenizer_model(cfg)))  # as a node's
    tok = engine.tokenizer
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt_ids = tok.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tok.encode(args.prompt)
    fields = {f.name: getattr(args, f.name) for f in msgspec.structs.fields(SamplingParams)}
    params = msgspec.convert({k: v for k, v in fields.items() if v is not None}, SamplingParams)
    for out in engine.generate([prompt_ids], params):
        sys.stdout.write(out.text)
    sys.stdout.write("\n")
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="colocated generation in this process; prints the text")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _add_sampling_flags(p, max_tokens=64, temperature=0.0)
    add_flags(p, EngineConfig)
    p.set_defaults(func=_generate)


def _add_sampling_flags(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """One flag per SamplingParams field (a new field gets its flag here by itself);
    `defaults` overrides the struct's (generate is greedy by default)."""
    from pdserve.common.sampling import SamplingParams

    for f in msgspec.structs.fields(SamplingParams):
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.default)
        bare = _bare(f.type)  # a range (Meta): msgspec.convert checks it below
        origin, args = typing.get_origin(bare), tuple(_bare(a) for a in typing.get_args(bare))
        if f.type is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif origin is tuple:  # stop, stop_token_ids: each use adds one item
            p.add_argument(flag, action="append", type=args[0], help="repeatable")
        else:
            kind = next((a for a in args if a is not type(None)), bare)  # int | None -> int
            p.add_argument(flag, type=kind, default=default)


def _bare(annotation: Any) -> Any:
    """`Annotated[T, Meta]` -> T; anything else as it is."""
    if typing.get_origin(annotation) is typing.Annotated:
        return typing.get_args(annotation)[0]
    return annotation


def _keygen(args: argparse.Namespace) -> int:
    from pdserve.common.wire.security import ClusterKey

    key = ClusterKey.generate()
    key.save(args.path)
    print(f"wrote {args.path} (public key {key.public.decode()}); give it to every process")
    return 0


def _add_serving(sub: argparse._SubParsersAction) -> None:
    from pdserve import launch
    from pdserve.up_commands import PER_NODE

    g = sub.add_parser("gateway", help="the HTTP gateway (one process)")
    add_config_flag(g)
    add_flags(g, GatewayConfig)
    g.set_defaults(func=launch.run_gateway)
    for role in ("prefill", "decode", "colocated"):
        p = sub.add_parser(role, help=f"one {role} node; it registers with --gateway")
        add_config_flag(p)
        add_flags(p, NodeConfig)
        add_flags(p, EngineConfig)
        p.set_defaults(func=lambda args, role=role: launch.run_node(args, role))
    up = sub.add_parser("up", help="local cluster: gateway + nodes as child processes")
    add_config_flag(up)
    up.add_argument("--prefill", type=int, default=1, help="prefill nodes")
    up.add_argument(
        "--gateways", type=int, default=1,
        help="gateways, each serving the whole API (gateway i on --port + 10 i, its control "
        "and tokens ports likewise); every node registers with all of them",
    )  # fmt: skip
    up.add_argument("--decode", type=int, default=1, help="decode nodes")
    up.add_argument(
        "--colocated",
        type=int,
        default=0,
        help="colocated nodes (prefill + decode in one engine; use with "
        "--prefill 0 --decode 0 for the baseline)",
    )
    for role in ("prefill", "decode"):
        up.add_argument(
            f"--{role}-threads", type=int, default=0,
            help=f"torch CPU threads of each {role} node; 0 = --num-threads (CPU count / nodes "
            "when that is 0 too). On one small host the phases mostly take turns, so each may "
            "take every core",
        )  # fmt: skip
        up.add_argument(
            f"--{role}-nice", type=int, default=0,
            help=f"CPU niceness added to each {role} node (os.nice): on one host, a prefill "
            "node at +10 gives way to decode steps instead of stalling the streams",
        )  # fmt: skip
    up.add_argument(
        "--decode-spin", type=int, default=3_000,
        help="when the nodes' threads outnumber the cores: the OpenMP spin count "
        "(GOMP_SPINCOUNT; libgomp spins ~100,000 per ms) of decode nodes' threads between "
        "parallel regions, ~30 us: long enough to bridge a decode step's regions, short "
        "enough to leave the cores to the prefill node and the event loop between them "
        "(measured: ~0.1 ms cost 1P1D's 16-stream ITL p99 +50 %%, ~10 us a batch-1 step "
        "+22 %%); 0: wait passively, as prefill nodes do",
    )  # fmt: skip
    up.add_argument(
        "--prefill-priority", choices=("normal", "idle"), default="normal",
        help="idle: prefill nodes' engine threads run under SCHED_IDLE (Linux, "
        "--engine-priority idle), on the CPU time decode nodes leave: on one host, a prompt "
        "never slows the streams decoding (TTFT pays instead)",
    )  # fmt: skip
    up.add_argument(
        "--node-metrics-port", type=int, default=0,
        help="the nodes serve /metrics, /health and /live on consecutive ports from this one "
        "(prefill nodes first, then decode, then colocated: node k on this + k), on "
        "PDSERVE_METRICS_HOST (default 127.0.0.1); 0 = off",
    )  # fmt: skip
    up.add_argument("--startup-timeout", type=float, default=300.0)
    up.add_argument(
        "--restart-hung-after", type=float, default=None,
        help="a node that served, then is listed by no answering gateway this many seconds "
        "while its process runs (hung: a frozen loop, a stuck step) is killed and restarted "
        "(default: 60, at least --drain-timeout + --heartbeat-timeout + 1); 0 = never",
    )  # fmt: skip
    up.add_argument(
        "--heartbeat-timeout", type=float, default=None,
        help="both heartbeat timeouts below at once (default: 2.0; env "
        "PDSERVE_HEARTBEAT_TIMEOUT)",
    )  # fmt: skip
    up.add_argument(
        "--gateway-heartbeat-timeout", type=float, default=None,
        help="seconds of silence before the gateway drops a node (default: --heartbeat-timeout)",
    )  # fmt: skip
    up.add_argument(
        "--node-heartbeat-timeout", type=float, default=None,
        help="seconds without a gateway reply before a node re-registers (default: "
        "--heartbeat-timeout)",
    )  # fmt: skip
    add_flags(up, GatewayConfig, skip=("model",))
    add_flags(up, EngineConfig)
    add_flags(up, NodeConfig, skip=PER_NODE)
    up.set_defaults(func=launch.run_up)
    if "PDSERVE_DTYPE" not in os.environ:  # a local cluster runs what this machine runs best
        up.set_defaults(dtype="auto")
        [dtype] = [a for a in up._actions if a.dest == "dtype"]
        dtype.help = (dtype.help or "").replace("(default: float32;", "(default: auto;")


# Commands that need none of the tools' parsers: the serving processes (`pdserve up` and the
# tests start hundreds of them), generate and keygen
LONG_RUNNING = ("gateway", "prefill", "decode", "colocated", "up")
SERVING = (*LONG_RUNNING, "generate", "keygen")


def _add_globals(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default=os.environ.get("PDSERVE_LOG_LEVEL", "WARNING"),
        help="DEBUG, INFO, WARNING, ERROR (env PDSERVE_LOG_LEVEL)",
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=os.environ.get("PDSERVE_LOG_FORMAT", "text"),
        help="text, or JSON lines for log collectors (env PDSERVE_LOG_FORMAT)",
    )


def command_of(argv: list[str]) -> str | None:
    """The sub-command `argv` names (None: none, or only --help)."""
    pre = argparse.ArgumentParser(prog="pdserve", add_help=False)
    _add_globals(pre)
    pre.add_argument("command", nargs="?")
    return pre.parse_known_args(argv)[0].command


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every sub-command's parser; for a serving process (`argv` names one) without the
    tools' (bench, compare, plan), whose modules import aiohttp's client, numpy and the
    planner: ~0.4 s of CPU at each process start."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    _add_globals(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    keygen = sub.add_parser(
        "keygen", help="write a cluster key file for --cluster-key (CurveZMQ, mode 0600)"
    )
    keygen.add_argument("path", help="file to write (e.g. cluster.key)")
    keygen.set_defaults(func=_keygen)
    _add_serving(sub)
    if argv is not None and command_of(argv) in SERVING:
        return parser
    from pdserve.loadgen.bench import add_parser as add_bench
    from pdserve.loadgen.compare import add_parser as add_compare
    from pdserve.planner.cli import add_parser as add_plan

    add_bench(sub)
    add_compare(sub)
    add_plan(sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse twice when a sub-command is given `--config FILE`: the file's values become that
    command's defaults, so the flags on the command line still win."""
    args = parser.parse_args(argv)
    path = getattr(args, "config_file", None)
    if path:
        command = _subcommands(parser)[args.command]
        try:
            apply_config_file(command, path)
        except ConfigError as exc:  # exit 2, as a bad flag does
            print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
            sys.exit(2)
        args = parser.parse_args(argv)
    return args


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _label(args: argparse.Namespace) -> str:
    """The process's name in its log lines: `pdserve up` interleaves its children's."""

    def given(name: str) -> str:  # the flag, else its PDSERVE_ variable (the config's rule)
        value = getattr(args, name, None)
        return os.environ.get(f"PDSERVE_{name.upper()}", "") if value is None else str(value)

    if args.command == "gateway":
        return f"gateway:{given('port') or GatewayConfig.port}"
    return given("node_id") or args.command


def main(argv: list[str] | None = None) -> int:
    # At exit the interpreter's last collections walk every object still alive (a torch
    # node's: ~0.45 s of CPU at each stop) only to free memory the OS takes back: frozen
    # first, by an exit handler (registered once; the others still run)
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parse_args(parser, argv)
    try:
        setup_logging(args.log_level, args.log_format, _label(args))
        return int(args.func(args))
    except (PdserveError, ValueError) as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or socket the system refused: said, not a traceback,
        # but for a serving process, which may fail so hours in (no file descriptor left, a
        # full disk): its log keeps where
        level = logging.ERROR if args.command in LONG_RUNNING else logging.DEBUG
        logging.getLogger("pdserve").log(level, "pdserve %s failed", args.command, exc_info=True)
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
