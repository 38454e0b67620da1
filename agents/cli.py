"""``meshwatch-agent``: run the node agent, or parse log text into JSON lines.

    meshwatch-agent run --server http://backend:8000 --bootstrap-token ... [options]
    meshwatch-agent parse nccl|xid|ethtool FILE|-
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

from agents.config import DEFAULT_COLLECTORS, ConfigError, load_config

PARSE_KINDS = ("nccl", "xid", "ethtool")


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    # default=None everywhere: a flag not given leaves the env, file or default value.
    add = parser.add_argument
    add("--config", type=Path, metavar="FILE",
        help="TOML config file (default: $MESHWATCH_CONFIG); flags > env > file > defaults")
    add("--server", help="backend base URL, e.g. http://meshwatch:8000 ($MESHWATCH_SERVER)")
    add("--node-id", dest="node_id",
        help="this node's id as the backend knows it (default: the hostname)")
    add("--rack", help="the ToR switch this node hangs off ($MESHWATCH_RACK)")
    add("--pod", help="the pod (spine group) of the rack ($MESHWATCH_POD)")
    add("--address", help="data-fabric IP address peers probe (default: the address of "
                          "the interface with the default route, else 127.0.0.1)")
    add("--probe-port", dest="probe_port", type=int,
        help="UDP port of the ping-mesh echo responder (default 7447)")
    add("--probe-bind-host", dest="probe_bind_host",
        help="address the echo responder binds to (default 0.0.0.0)")
    add("--flows", type=int, help="probe flows (UDP source ports) per peer, for ECMP (default 4)")
    add("--dscp", type=int, help="DSCP value of probe packets (default 0)")
    add("--collectors", help="comma-separated collectors to enable (default: "
                             f"{','.join(DEFAULT_COLLECTORS)}); missing hardware reports nothing")
    add("--nccl-log-glob", dest="nccl_log_globs", action="append", metavar="GLOB",
        help="NCCL/PyTorch log files to follow for the nccl collector (repeatable)")
    add("--job-id", dest="job_id", help="training job id to tag events with ($MESHWATCH_JOB_ID)")
    add("--state-dir", dest="state_dir", type=Path,
        help="folder for the spool and the node token (default /var/lib/meshwatch-agent as "
             "root, else ~/.local/state/meshwatch-agent)")
    add("--spool-max-bytes", dest="spool_max_bytes", type=int,
        help="bound of the on-disk spool; when full the oldest batches are dropped "
             "(default 268435456 = 256 MiB)")
    add("--batch-interval", dest="batch_interval", type=float,
        help="seconds between batches sent to the backend (default 1)")
    add("--pinglist-interval", dest="pinglist_interval", type=float,
        help="seconds between pinglist refreshes (default 10)")
    add("--final-flush-seconds", dest="final_flush_seconds", type=float,
        help="on SIGTERM, how long to try sending what is spooled (default 3)")
    add("--bootstrap-token", dest="bootstrap_token",
        help="token to register with; prefer $MESHWATCH_BOOTSTRAP_TOKEN, since flags are "
             "visible to other users in the process list")
    add("--no-tasks", dest="tasks", action="store_const", const=False,
        help="do not run benchmark tasks handed out by the backend (bisection)")
    add("--allow-command", dest="allowed_commands", action="append", metavar="PROGRAM",
        help="program a `command` benchmark task may run (repeatable; * allows any)")
    add("--bench-send-limit-bps", dest="bench_send_limit_bps", type=float,
        help="cap this node's benchmark sends at this many bits/s (lab knob: a slow node)")
    add("--log-level", dest="log_level", choices=("debug", "info", "warning", "error"),
        help="log level (default info)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshwatch-agent", description="meshwatch node agent: GPU cluster fault detection."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="run the node agent daemon",
                              description="Run the node agent until SIGTERM/SIGINT.")
    _add_run_flags(run)
    parse = commands.add_parser(
        "parse", help="parse log text into JSON events, one object per line",
        description="Print one JSON object per line for each event found in FILE (- = stdin).",
    )
    parse.add_argument("kind", choices=PARSE_KINDS,
                       help="nccl: NCCL/PyTorch logs; xid: kernel Xid lines; ethtool: ethtool -S")
    parse.add_argument("file", metavar="FILE", help="file to read, or - for stdin")
    return parser


def _lines(stream: TextIO) -> Iterator[str]:
    for line in stream:
        yield line.rstrip("\r\n")


def _parse(kind: str, file: str) -> int:
    from agents.parsers import parse_lines

    if file == "-":
        stream: TextIO = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
    else:
        try:
            stream = open(file, encoding="utf-8", errors="replace")  # noqa: SIM115
        except OSError as exc:
            print(f"meshwatch-agent parse: {file}: {exc.strerror}", file=sys.stderr)
            return 2
    try:
        with stream:
            try:
                events = parse_lines(kind, _lines(stream))
            except (ValueError, LookupError) as exc:
                # An unknown kind or a parser missing from this build.
                print(f"meshwatch-agent parse: {exc}", file=sys.stderr)
                return 2
            for event in events:
                # json.dumps escapes newlines inside strings, so one event stays one line.
                sys.stdout.write(json.dumps(event, default=str, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # A reader like `head` went away: not an error of ours.
        sys.stderr.close()
    return 0


def _run(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        config = load_config(flags, config_file=args.config)
    except ConfigError as exc:
        print(f"meshwatch-agent: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if config.log_level != "debug":
        # httpx logs every request at INFO: one line a second per batch is noise.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    from agents.daemon import AgentDaemon

    return asyncio.run(AgentDaemon(config).run())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshwatch-agent`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "parse":
        return _parse(args.kind, args.file)
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
