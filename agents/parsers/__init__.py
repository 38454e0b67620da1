"""Pure text parsers: NCCL/PyTorch logs, kernel Xid lines, ethtool -S output.

``parse_lines(kind, lines)`` is the one entry point the CLI
(``meshwatch-agent parse nccl|xid|ethtool FILE|-``) and the collectors use;
each event is a plain dict that serialises to JSON as is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

PARSE_KINDS = ("nccl", "xid", "ethtool")

LineParser = Callable[[Iterable[str]], Iterator[dict[str, Any]]]


class ParserUnavailableError(LookupError):
    """The parser for a known kind is not installed in this build."""


def _text_lines(lines: Iterable[str | bytes]) -> Iterator[str]:
    # Logs carry binary junk now and then; never let one byte stop a parse.
    for item in lines:
        yield item.decode("utf-8", errors="replace") if isinstance(item, bytes) else item


def _nccl_parser() -> LineParser:
    from agents.parsers.nccl import parse_lines as _nccl_lines

    return _nccl_lines


def _xid_parser() -> LineParser:
    from agents.parsers.xid import parse_lines as _xid_lines

    return _xid_lines


def _ethtool_parser() -> LineParser:
    try:
        from agents.parsers.ethtool import parse_lines as _ethtool_lines
    except ImportError as exc:
        raise ParserUnavailableError(
            "the ethtool parser (agents.parsers.ethtool.parse_lines) is not part of this build"
        ) from exc
    return _ethtool_lines


_DISPATCH: dict[str, Callable[[], LineParser]] = {
    "nccl": _nccl_parser,
    "xid": _xid_parser,
    "ethtool": _ethtool_parser,
}


def parse_lines(kind: str, lines: Iterable[str | bytes]) -> Iterator[dict[str, Any]]:
    """Events found in ``lines`` by the parser for ``kind`` (one of PARSE_KINDS).

    Raises ValueError for an unknown kind and ParserUnavailableError when the
    kind's parser is not installed, both at call time, before any line is read.
    Lines that say nothing the parser knows yield nothing.
    """
    factory = _DISPATCH.get(kind)
    if factory is None:
        raise ValueError(f"unknown parse kind {kind!r}; expected one of {PARSE_KINDS}")
    parser = factory()
    return parser(_text_lines(lines))


__all__ = ["PARSE_KINDS", "ParserUnavailableError", "parse_lines"]
