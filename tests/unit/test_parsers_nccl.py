"""NCCL / PyTorch log parser on real log lines (tests/fixtures/nccl, see SOURCES.md)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from agents.parsers import parse_lines
from agents.parsers.nccl import (
    CORE_FIELDS,
    EVENT_KINDS,
    RULES_DIR,
    SEVERITIES,
    NcclLogParser,
    RuleFileError,
    load_rule_file,
    load_rules,
    peel_prefixes,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nccl"
FIXTURE_FILES = sorted(FIXTURES.glob("*.log"))


def events(name: str) -> list[dict]:
    return list(parse_lines("nccl", (FIXTURES / name).read_bytes().splitlines()))


def all_fixture_messages() -> list[str]:
    messages = []
    for path in FIXTURE_FILES:
        for raw in path.read_bytes().splitlines():
            messages.append(peel_prefixes(raw.decode("utf-8", errors="replace"))[0])
    return messages


def test_fixtures_and_their_sources_exist() -> None:
    sources = (FIXTURES / "SOURCES.md").read_text()
    assert FIXTURE_FILES
    for path in FIXTURE_FILES:
        assert path.name in sources, f"{path.name} has no source in SOURCES.md"


@pytest.mark.parametrize("rule_file", sorted(RULES_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_rule_matches_a_real_line(rule_file: Path) -> None:
    rules = load_rule_file(rule_file)
    messages = all_fixture_messages()
    for rule in rules:
        assert any(rule.pattern.search(m) for m in messages), (
            f"{rule_file.name} rule #{rule.index} ({rule.reason or rule.type}) "
            "matches no line of tests/fixtures/nccl"
        )


def test_shipped_rules_load_in_priority_order() -> None:
    rules = load_rules()
    assert [r.priority for r in rules] == sorted(r.priority for r in rules)
    assert {r.type for r in rules} == {"nccl_timeout", "nccl_error", "context"}


def write_rules(tmp_path: Path, rules: list[dict]) -> Path:
    path = tmp_path / "custom.json"
    path.write_text(json.dumps({"source": "test", "rules": rules}))
    return path


def test_bad_regex_fails_the_load_naming_file_and_rule(tmp_path: Path) -> None:
    ok = {"type": "nccl_error", "reason": "x", "severity": "error", "pattern": "NCCL WARN"}
    bad = dict(ok, pattern="Watchdog caught (")
    path = write_rules(tmp_path, [ok, bad])
    with pytest.raises(RuleFileError, match=r"custom\.json rule #1: bad regex"):
        load_rule_file(path)


@pytest.mark.parametrize(
    "rule, message",
    [
        ({"type": "nccl_hang", "reason": "x", "severity": "error", "pattern": "a"}, "type"),
        ({"type": "nccl_error", "reason": "x", "severity": "fatal", "pattern": "a"}, "severity"),
        (
            {"type": "nccl_error", "reason": "Bad Reason", "severity": "error", "pattern": "a"},
            "reason",
        ),
        (
            {"type": "nccl_error", "reason": "x", "severity": "error", "pattern": "a", "x": 1},
            "unknown",
        ),
        ({"type": "context", "pattern": "no groups"}, "named groups"),
    ],
)
def test_malformed_rules_are_refused(tmp_path: Path, rule: dict, message: str) -> None:
    with pytest.raises(RuleFileError, match=message):
        load_rule_file(write_rules(tmp_path, [rule]))


def test_every_event_is_json_with_the_core_fields_and_its_line() -> None:
    count = 0
    for path in FIXTURE_FILES:
        lines = path.read_text(encoding="utf-8").splitlines()
        for event in parse_lines("nccl", lines):
            count += 1
            assert event["kind"] in EVENT_KINDS
            assert event["severity"] in SEVERITIES
            assert set(CORE_FIELDS) <= set(event)
            assert event["message"] in lines
            json.dumps(event)
    assert count > 80


def test_current_watchdog_timeout_gives_rank_seq_op_sizes_and_times() -> None:
    first = events("llamafactory_7396_numbered.log")[0]
    assert first["kind"] == "nccl_timeout"
    assert first["reason"] == "watchdog_timeout"
    assert (first["rank"], first["seq"], first["op"]) == (0, 1580, "ALLREDUCE")
    assert (first["numel_in"], first["numel_out"]) == (466119168, 466119168)
    assert (first["timeout_ms"], first["ran_ms"]) == (600000, 600060)


def test_old_watchdog_timeout_without_element_counts() -> None:
    found = events("ofa_271_v100.log")
    assert [e["rank"] for e in found] == [1, 3, 2, 6, 7]
    assert {e["seq"] for e in found} == {469508}
    assert all(e["numel_in"] is None and e["numel_out"] is None for e in found)
    assert found[0]["timeout_ms"] == 1800000 and found[0]["ran_ms"] == 1802212


def test_timeout_behind_a_progress_bar_is_found() -> None:
    first = events("pytorch_118369_progress_bar.log")[0]
    assert (first["rank"], first["seq"], first["ran_ms"]) == (0, 96120, 25624887)


def test_timeout_without_rank_has_rank_none() -> None:
    (only,) = events("megatron_1207_title.log")
    assert only["rank"] is None and only["seq"] == 5 and only["op"] == "ALLREDUCE"


def test_process_group_tag_gives_pg_and_work_status() -> None:
    status = [
        e for e in events("llamafactory_7396_numbered.log") if e["reason"] != "watchdog_timeout"
    ]
    assert [(e["pg"], e["rank"]) for e in status] == [("1", 0), ("1", 3)]
    assert status[0]["seq"] == 1580
    assert (status[0]["last_enqueued"], status[0]["last_completed"]) == (1582, 1579)


def test_pg_guid_tag_of_newer_pytorch() -> None:
    status = events("basicsr_737_pg_guid.log")[1]
    assert status["reason"] == "watchdog_work_status"
    assert (status["pg"], status["pg_name"], status["rank"], status["seq"]) == (
        "0",
        "default_pg",
        1,
        808,
    )


def test_watchdog_termination_is_critical_and_keeps_the_collective() -> None:
    (term,) = events("deepspeed_7533_terminated.log")
    assert term["kind"] == "nccl_error" and term["severity"] == "critical"
    assert term["reason"] == "watchdog_terminated"
    assert (term["rank"], term["pg"], term["seq"], term["op"]) == (5, "0", 460631, "ALLREDUCE")


def test_unsigned_minus_one_counts_and_unstarted_work() -> None:
    status, term = events("nccl_1504_coalesced.log")
    assert status["last_completed"] == -1
    assert term["op"] == "COALESCED" and term["numel_in"] == 2**64 - 1


def test_blocking_wait_timeout() -> None:
    found = events("diffusers_12422_blocking_wait.log")
    waits = [e for e in found if e["reason"] == "blocking_wait_timeout"]
    assert [(e["rank"], e["seq"]) for e in waits] == [(1, 2521), (7, 2521)]
    assert all(e["kind"] == "nccl_timeout" for e in waits)


def test_prefixes_of_launchers_and_log_shippers() -> None:
    chitu = events("chitu_80_timestamp_host.log")
    assert chitu[1]["host"] == "sm228-a100-40g-23" and chitu[1]["rank"] == 1
    ray = events("vllm_6042_ray_prefix.log")
    assert [(e["rank"], e["seq"]) for e in ray] == [(1, 158046), (1, 158046)]
    hang = events("ms_swift_7992_watchdog_hang.log")
    assert hang[0]["reason"] == "watchdog_hang"
    assert hang[0]["pg_name"] == "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP"


def test_pdsh_host_prefix_is_read_and_info_lines_are_not_events() -> None:
    line = (FIXTURES / "transformers_22363_pdsh.log").read_text().splitlines()[0]
    rest, fields = peel_prefixes(line)
    assert fields == {"host": "gpu1505"}
    assert rest.startswith("gpu1505:22060:22174 [0] NCCL INFO")
    ip_line = (FIXTURES / "accelerate_1317_pdsh.log").read_text().splitlines()[0]
    assert peel_prefixes(ip_line)[1] == {"host": "104.171.201.172"}
    assert events("transformers_22363_pdsh.log") == []
    assert events("accelerate_1317_pdsh.log") == []


@pytest.mark.parametrize(
    "line",
    [
        "RuntimeError: NCCL error in: ../torch/lib/c10d/ProcessGroupNCCL.cpp:839, x",
        "ncclRemoteError: A call failed possibly due to a network error",
        "  traceback : Signal 7 (SIGBUS) received by PID 986",
        "error: something",
    ],
)
def test_words_followed_by_a_colon_are_not_taken_for_hosts(line: str) -> None:
    assert "host" not in peel_prefixes(line)[1]


def test_ib_completion_error_gives_host_device_peer_and_status() -> None:
    (ib,) = [
        e
        for e in events("deepspeed_2931_ib_completion.log")
        if e["reason"] == "ib_completion_error"
    ]
    assert ib["host"] == "PHLRR4036" and ib["device"] == 2
    assert ib["peer"] == "10.226.98.98<48598>"
    assert (ib["status"], ib["vendor_err"]) == (12, 129)
    newer = events("nccl_1405_ib_status12.log")
    assert [(e["status"], e["vendor_err"], e["host"]) for e in newer] == [
        (12, 129, "kp-ddp-worker-0"),
        (12, 129, "kp-ddp-worker-0"),
    ]
    (err4,) = events("nccl_tests_252_ib_error4.log")
    assert (err4["status"], err4["vendor_err"], err4["host"]) == (4, 81, "kolyoz2")


def test_the_root_cause_wins_on_a_line_that_says_several_things() -> None:
    (only,) = events("stanford_alpaca_207_one_line.log")
    assert only["reason"] == "ib_completion_error" and only["status"] == 12


def test_socket_and_verbs_failures() -> None:
    call, proxy, closed = events("nccl_795_socket.log")
    assert call["reason"] == "socket_call_failed"
    assert (call["peer"], call["detail"]) == ("10.200.84.247<58355>", "Broken pipe")
    assert proxy["reason"] == "proxy_operation_failed"
    assert (proxy["proxy_op"], proxy["peer_rank"], proxy["retcode"]) == ("Connect", 9, 6)
    assert closed["reason"] == "connection_closed_by_peer"
    assert closed["host"] == "a100-st-p4d24xlarge-22"
    calls = [
        events(name)[0]["call"]
        for name in (
            "nccl_562_ibv_create_qp.log",
            "horovod_1651_ibv_create_qp.log",
            "nccl_380_ibv_create_cq.log",
            "nccl_tests_185_title.log",
        )
    ]
    assert calls == ["ibv_create_qp", "ibv_create_qp", "ibv_create_cq", "ibv_modify_qp"]
    (connect,) = events("sglang_6017_socket_connect.log")
    assert connect["peer"] == "169.254.20.10<43369>"
    warn = events("deepspeedexamples_310_async_event.log")
    assert {(e["reason"], e["severity"]) for e in warn} == {("nccl_warn", "warning")}


@pytest.mark.parametrize(
    "name, reasons, version",
    [
        ("nccl_1141_title.log", ["remote_error"], "2.18.6"),
        (
            "nccl_1514_internal_error.log",
            ["internal_error", "internal_error", "connection_closed_by_peer"],
            "2.14.3",
        ),
        ("pytorch_111187_title.log", ["unhandled_cuda_error"], None),
        (
            "restormer_75_unhandled_cuda.log",
            ["unhandled_cuda_error", "unhandled_cuda_error"],
            "2.7.8",
        ),
        ("megatron_71_title.log", ["unhandled_system_error"], "2.8.3"),
        (
            "belle_434_system_error.log",
            ["unhandled_system_error", "unhandled_system_error"],
            "21.1.4",
        ),
        ("nccl_1241_title.log", ["invalid_usage"], "2.17.1"),
        ("cuad_9_nccl_error_1.log", ["unhandled_cuda_error"], None),
    ],
)
def test_nccl_result_lines(name: str, reasons: list[str], version: str | None) -> None:
    found = events(name)
    assert [e["reason"] for e in found] == reasons
    assert found[0].get("nccl_version") == version


def test_rank_prefix_applies_to_error_lines() -> None:
    found = events("nccl_1928_rank_prefix.log")
    assert [(e["reason"], e["rank"]) for e in found] == [("remote_error", 3), ("remote_error", 3)]


def test_torchrun_summary_gives_one_event_per_failed_worker() -> None:
    found = events("mmsegmentation_3106_elastic.log")
    assert found[0]["reason"] == "child_failed"
    workers = found[1:]
    assert [(e["rank"], e["local_rank"], e["exitcode"], e["pid"]) for e in workers] == [
        (1, 1, -6, 2385923),
        (2, 2, -6, 2385924),
    ]
    assert {e["signal"] for e in workers} == {"SIGABRT"}
    assert {e["host"] for e in workers} == {"neptun.informatik.uni-kl.de"}


def test_torchrun_summary_without_signal() -> None:
    found = events("pytorch_121209_elastic.log")
    assert [(e["rank"], e["exitcode"]) for e in found] == [(1, 1), (2, 1), (3, 1), (0, 1)]
    assert all("signal" not in e for e in found)


def test_torchrun_agent_line_and_a_traceback_out_of_context() -> None:
    (agent,) = events("pytorch_126544_elastic_agent.log")
    assert (agent["exitcode"], agent["local_rank"], agent["pid"], agent["rank"]) == (
        -6,
        0,
        970611,
        None,
    )
    (old,) = events("minigpt4_237_elastic_agent.log")
    assert (old["exitcode"], old["pid"]) == (-6, 16)
    # A traceback line with no worker block before it is not a worker failure.
    assert events("megatron_516_signal_only.log") == []


def test_binary_junk_and_cut_lines_never_raise_and_hide_nothing() -> None:
    rng = random.Random(1234)
    clean = (FIXTURES / "basicsr_737_pg_guid.log").read_bytes().splitlines()
    noisy: list[bytes] = []
    for line in clean:
        noisy.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))))
        noisy.append(line)
        noisy.append(line[: rng.randrange(len(line))])  # a line cut short
    expected = [e["reason"] for e in parse_lines("nccl", clean)]
    found = [e["reason"] for e in parse_lines("nccl", noisy)]
    # Cut copies may still match (a cut after the seq numbers is a valid line);
    # every clean event must be there, in order.
    it = iter(found)
    assert all(reason in it for reason in expected)


def test_random_bytes_yield_nothing_and_never_raise() -> None:
    rng = random.Random(99)
    chunks = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 4096))) for _ in range(200)]
    assert list(parse_lines("nccl", chunks)) == []
    parser = NcclLogParser()
    assert parser.parse_line("x" * 1_000_000) is None
