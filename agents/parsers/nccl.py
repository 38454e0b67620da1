"""Parse NCCL and PyTorch distributed log lines into events.

What to match is data: the JSON files under ``agents/parsers/rules/`` (source,
rules: type, reason, severity, pattern), compiled once at load; a bad regex or
an unknown field fails the load with the file and rule named. This module only
knows the line shapes every rule shares: the prefixes launchers put in front of
a line (timestamps, ``[rank3]:``, ``[default0]:``, pdsh's ``node-3: ``), the
``[PG ... Rank N]`` tag PyTorch writes, NCCL's own ``host:pid:tid [dev]``
prefix, and the ``WorkNCCL(SeqNum=.., OpType=.., ...)`` description of a
collective.

One event per line at most: the first event rule that matches wins, in the
order of the rules' priority.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

RULES_DIR = Path(__file__).with_name("rules")

EVENT_KINDS = ("nccl_timeout", "nccl_error")
SEVERITIES = ("info", "warning", "error", "critical")
# Every event carries these keys (None when the line does not say).
CORE_FIELDS = (
    "rank",
    "seq",
    "op",
    "numel_in",
    "numel_out",
    "timeout_ms",
    "ran_ms",
    "pg",
    "host",
)
INT_FIELDS = frozenset(
    {
        "rank",
        "local_rank",
        "seq",
        "numel_in",
        "numel_out",
        "timeout_ms",
        "ran_ms",
        "last_enqueued",
        "last_completed",
        "status",
        "vendor_err",
        "exitcode",
        "pid",
        "signal_number",
        "peer_rank",
        "retcode",
        "device",
        "nccl_pid",
    }
)
# Groups that only feed other fields; never part of an event.
_INTERNAL_FIELDS = frozenset({"work", "tid"})

# A log line longer than this is cut before matching: rules look at the start
# of a message, and a megabyte of junk must not cost a megabyte of regex work.
MAX_LINE_CHARS = 16_384

_RULE_KEYS = {
    "type",
    "reason",
    "severity",
    "pattern",
    "uses_context",
    "requires",
    "reset",
    "priority",
}


class RuleFileError(ValueError):
    """A rule file is malformed; the message names the file and the rule."""


@dataclass(frozen=True)
class LogRule:
    """One compiled rule: an event rule (nccl_timeout / nccl_error) or a context rule."""

    source: str
    type: str
    pattern: re.Pattern[str]
    reason: str | None = None
    severity: str | None = None
    uses_context: bool = False
    requires: tuple[str, ...] = ()
    reset: bool = False
    priority: int = 100
    file: str = ""
    index: int = 0

    @property
    def is_event(self) -> bool:
        return self.type in EVENT_KINDS


def load_rule_file(path: Path) -> list[LogRule]:
    """Load and compile one rule file, failing fast on anything malformed."""
    where = path.name
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise RuleFileError(f"{where}: cannot read rule file: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("source"), str):
        raise RuleFileError(f"{where}: needs an object with a 'source' string")
    rules = doc.get("rules")
    if not isinstance(rules, list) or not rules:
        raise RuleFileError(f"{where}: needs a non-empty 'rules' list")
    file_priority = doc.get("priority", 100)
    if not isinstance(file_priority, int):
        raise RuleFileError(f"{where}: 'priority' must be an integer")
    compiled = []
    for index, raw in enumerate(rules):
        compiled.append(_compile_rule(raw, doc["source"], file_priority, where, index))
    return compiled


def _compile_rule(raw: Any, source: str, file_priority: int, where: str, index: int) -> LogRule:
    label = f"{where} rule #{index}"
    if not isinstance(raw, dict):
        raise RuleFileError(f"{label}: must be an object")
    unknown = set(raw) - _RULE_KEYS
    if unknown:
        raise RuleFileError(f"{label}: unknown keys {sorted(unknown)}")
    kind = raw.get("type")
    if kind not in EVENT_KINDS and kind != "context":
        raise RuleFileError(f"{label}: type must be one of {EVENT_KINDS + ('context',)}")
    pattern = raw.get("pattern")
    if not isinstance(pattern, str) or not pattern:
        raise RuleFileError(f"{label}: needs a 'pattern' string")
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise RuleFileError(f"{label}: bad regex {pattern!r}: {exc}") from exc
    reason = raw.get("reason")
    severity = raw.get("severity")
    if kind in EVENT_KINDS:
        if not isinstance(reason, str) or not re.fullmatch(r"[a-z0-9_]+", reason):
            raise RuleFileError(f"{label}: event rules need a snake_case 'reason'")
        if severity not in SEVERITIES:
            raise RuleFileError(f"{label}: severity must be one of {SEVERITIES}")
    elif not regex.groupindex and not raw.get("reset"):
        raise RuleFileError(f"{label}: a context rule must capture named groups or reset")
    requires = raw.get("requires", [])
    if not isinstance(requires, list) or not all(isinstance(r, str) for r in requires):
        raise RuleFileError(f"{label}: 'requires' must be a list of field names")
    priority = raw.get("priority", file_priority)
    if not isinstance(priority, int):
        raise RuleFileError(f"{label}: 'priority' must be an integer")
    return LogRule(
        source=source,
        type=kind,
        pattern=regex,
        reason=reason,
        severity=severity,
        uses_context=bool(raw.get("uses_context", False)),
        requires=tuple(requires),
        reset=bool(raw.get("reset", False)),
        priority=priority,
        file=where,
        index=index,
    )


def load_rules(directory: Path = RULES_DIR) -> tuple[LogRule, ...]:
    """Load every ``*.json`` rule file of a folder, ordered by priority (stable)."""
    files = sorted(directory.glob("*.json"))
    if not files:
        raise RuleFileError(f"{directory}: no rule files")
    rules: list[LogRule] = []
    for path in files:
        rules.extend(load_rule_file(path))
    return tuple(sorted(rules, key=lambda r: r.priority))


@lru_cache(maxsize=1)
def default_rules() -> tuple[LogRule, ...]:
    """The shipped rules, compiled once per process."""
    return load_rules(RULES_DIR)


# Prefixes launchers and log collectors put before the message, peeled off the
# start of the line one at a time. Named groups are kept as fields.
_PREFIXES = tuple(
    re.compile(p)
    for p in (
        # 2025-03-27 17:31:09.952 / 2024-01-08T16:13:55Z
        r"^\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?\s+",
        # [2024-01-08 16:13:55,768]
        r"^\[\d{4}-\d{2}-\d{2}[ T][^\]]{0,40}\]\s*",
        # Mar 29 15:38:59
        r"^[A-Z][a-z]{2} [ \d]\d \d{2}:\d{2}:\d{2}\s+",
        # mpirun --tag-output "[1,0]<stderr>:" and line numbers "[80746] "
        r"^\[\d+(?:,\d+)*\](?:<std(?:out|err)>:|:?\s+)\s*",
        # torchrun --tee / --log-dir: "[default3]:"
        r"^\[default(?P<local_rank>\d+)\]:\s*",
        # PyTorch >= 2.2 rank prefix: "[rank3]:"
        r"^\[rank(?P<rank>\d+)\]:\s*",
        # Ray workers: "(RayWorkerWrapper pid=4009) " / "(WorkerDict pid=830, ip=1.2.3.4) "
        r"^\([A-Za-z_][\w.]*\s+pid=\d+(?:,\s*ip=[\d.]+)?\)\s+",
        # "host [stderr] "
        r"^(?P<host>[A-Za-z0-9][\w.-]*) \[(?:stdout|stderr)\]\s+",
        # a bare host name in front of "[rankN]:"
        r"^(?P<host>[a-z0-9][a-z0-9.-]*[a-z0-9])\s+(?=\[rank\d+\]:)",
        # pdsh / DeepSpeed multi-node launcher: "node-3: " or "10.0.0.7: "
        r"^(?P<host>[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?):\s+",
    )
)
_PDSH_HOST = re.compile(r"^(?P<host>[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?):\s+")
_RANK_TAG = re.compile(
    r"\[(?:PG (?:ID )?(?P<pg>\d+)(?: PG GUID (?P<pg_guid>\d+))?\s*"
    r"(?:\((?P<pg_name>[^)\]]*)\))?\s+)?Rank (?P<rank>\d+)\]"
)
_NCCL_PREFIX = re.compile(
    r"(?:^|\s)(?P<host>[A-Za-z0-9][\w.-]*):(?P<nccl_pid>\d+):(?P<tid>\d+) \[(?P<device>\d+)\]"
)
_WORK_FIELD = re.compile(r"(SeqNum|OpType|NumelIn|NumelOut|Timeout\(ms\))=([^,\s)]+)")
_WORK_NAMES = {
    "SeqNum": "seq",
    "OpType": "op",
    "NumelIn": "numel_in",
    "NumelOut": "numel_out",
    "Timeout(ms)": "timeout_ms",
}
_INT_TEXT = re.compile(r"-?\d{1,20}")


def _looks_like_pdsh_host(host: str) -> bool:
    # Without this "error: ..." or "note: ..." would read as a host name.
    return any(c.isdigit() or c in "-." for c in host)


def peel_prefixes(line: str) -> tuple[str, dict[str, str]]:
    """Strip launcher prefixes from the start of a line; return the rest and what they said."""
    fields: dict[str, str] = {}
    rest = line
    for _ in range(8):
        for prefix in _PREFIXES:
            m = prefix.match(rest)
            if not m or not m.group(0):
                continue
            if prefix.pattern == _PDSH_HOST.pattern and not _looks_like_pdsh_host(m["host"]):
                continue
            for key, value in m.groupdict().items():
                if value is not None:
                    fields.setdefault(key, value)
            rest = rest[m.end() :]
            break
        else:
            break
    return rest, fields


def _line_tags(message: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    tag = _RANK_TAG.search(message)
    if tag:
        fields.update({k: v for k, v in tag.groupdict().items() if v is not None})
    nccl = _NCCL_PREFIX.search(message)
    if nccl:
        fields.update({k: v for k, v in nccl.groupdict().items() if v is not None})
    return fields


def _work_fields(work: str) -> dict[str, str]:
    return {_WORK_NAMES[name]: value for name, value in _WORK_FIELD.findall(work)}


def _typed(fields: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if key in INT_FIELDS and _INT_TEXT.fullmatch(value):
            out[key] = int(value)
        else:
            out[key] = value
    return out


class NcclLogParser:
    """Turns NCCL / PyTorch log lines into event dicts.

    Keep one parser per log stream: torchrun's failure summary spreads one
    worker's failure (host, rank, exit code) over several lines, and the
    parser carries those fields from line to line.
    """

    def __init__(self, rules: Iterable[LogRule] | None = None) -> None:
        all_rules = tuple(rules) if rules is not None else default_rules()
        self._context_rules = tuple(r for r in all_rules if not r.is_event)
        self._event_rules = tuple(r for r in all_rules if r.is_event)
        self._context: dict[str, str] = {}

    def parse_line(self, line: str | bytes) -> dict[str, Any] | None:
        """Return the event this line reports, or None."""
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        line = line.rstrip("\r\n")
        text = line[:MAX_LINE_CHARS]
        message, prefix_fields = peel_prefixes(text)

        for rule in self._context_rules:
            m = rule.pattern.search(message)
            if not m:
                continue
            if rule.reset:
                self._context.clear()
            self._context.update({k: v for k, v in m.groupdict().items() if v is not None})

        for rule in self._event_rules:
            m = rule.pattern.search(message)
            if m:
                return self._event(rule, m, line, message, prefix_fields)
        return None

    def _event(
        self,
        rule: LogRule,
        match: re.Match[str],
        line: str,
        message: str,
        prefix_fields: dict[str, str],
    ) -> dict[str, Any] | None:
        fields: dict[str, str] = dict(prefix_fields)
        fields.update(_line_tags(message))
        if rule.uses_context:
            fields.update(self._context)
        groups = {k: v for k, v in match.groupdict().items() if v is not None}
        fields.update(groups)
        if "work" in groups:
            # Explicit groups of the rule win over what the WorkNCCL text says.
            for key, value in _work_fields(groups["work"]).items():
                if key not in groups:
                    fields[key] = value
        if any(name not in fields for name in rule.requires):
            return None
        if rule.uses_context:
            self._context.clear()

        typed = _typed({k: v for k, v in fields.items() if k not in _INTERNAL_FIELDS})
        event: dict[str, Any] = {
            "kind": rule.type,
            "severity": rule.severity,
            "reason": rule.reason,
        }
        for name in CORE_FIELDS:
            event[name] = typed.pop(name, None)
        event.update(sorted(typed.items()))
        event["source"] = rule.source
        event["message"] = line
        return event


def parse_lines(lines: Iterable[str | bytes]) -> Iterator[dict[str, Any]]:
    """Events from a stream of log lines (str or bytes; embedded newlines are split)."""
    parser = NcclLogParser()
    for item in lines:
        if isinstance(item, bytes):
            item = item.decode("utf-8", errors="replace")
        for line in item.splitlines() or [item]:
            event = parser.parse_line(line)
            if event is not None:
                yield event
