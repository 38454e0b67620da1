"""Xid parser and catalogue on real kernel log lines (tests/fixtures/xid, see SOURCES.md)."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from agents.parsers import PARSE_KINDS, ParserUnavailableError, parse_lines
from agents.parsers.xid import (
    CATALOG_PATH,
    SEVERITIES,
    catalog_entry,
    event_severity,
    load_catalog,
    parse_xid_line,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "xid"

# The Xids the NVIDIA catalogue must cover here, with the immediate action it gives.
REQUIRED = {
    8: "RESTART_APP",
    13: "RESTART_APP",
    31: "RESTART_APP",
    32: "RESTART_APP",
    38: "IGNORE",
    43: "IGNORE",
    45: "WORKFLOW_XID_45",
    48: "WORKFLOW_XID_48",
    61: "CONTACT_SUPPORT",
    62: "RESET_GPU",
    63: "IGNORE",
    64: "RESET_GPU",
    69: "RESTART_APP",
    74: "WORKFLOW_NVLINK_ERR",
    79: "RESTART_BM",
    92: "IGNORE",
    94: "RESTART_APP",
    95: "RESET_GPU",
    109: "RESET_GPU",
    119: "RESET_GPU",
    120: "RESET_GPU",
    121: "IGNORE",
    140: "RESET_GPU",
    143: "RESET_GPU",
    154: "XID_154",
    **{n: "WORKFLOW_NVLINK5_ERR" for n in range(144, 151)},
}


def events(name: str) -> list[dict]:
    return list(parse_lines("xid", (FIXTURES / name).read_bytes().splitlines()))


def test_fixtures_and_their_sources_exist() -> None:
    sources = (FIXTURES / "SOURCES.md").read_text()
    for path in sorted(FIXTURES.glob("*.log")):
        assert path.name in sources, f"{path.name} has no source in SOURCES.md"


def test_catalogue_names_its_source_and_covers_the_required_xids() -> None:
    doc = json.loads(CATALOG_PATH.read_text())
    assert doc["source"] == "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
    for xid, action in REQUIRED.items():
        entry = catalog_entry(xid)
        assert entry is not None, f"Xid {xid} missing from the catalogue"
        assert entry["action"] == action, f"Xid {xid}"
        assert entry["severity"] in SEVERITIES
        assert entry["description"] and entry["mnemonic"]
    # The severity of each entry follows the file's own action -> severity table.
    for key, entry in doc["xids"].items():
        assert entry["severity"] == doc["severity_by_action"][entry["action"]], key
    assert catalog_entry(79)["mnemonic"] == "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS"
    assert catalog_entry(48)["severity"] == "critical"
    assert catalog_entry(43)["severity"] == "info"


def test_current_format_with_pid_and_process() -> None:
    (xid,) = events("modal_gpu_health.log")
    assert (xid["kind"], xid["pci"], xid["xid"]) == ("xid", "0000:c6:00", 79)
    assert (xid["pid"], xid["process"]) == (1101234, "nvc:[driver]")
    assert xid["message"] == "GPU has fallen off the bus."
    assert (xid["action"], xid["severity"]) == ("RESTART_BM", "critical")
    assert xid["description"] == "GPU has fallen off the bus"


def test_unknown_pid_and_process_are_none() -> None:
    found = events("gpud_46_dmesg_ctime.log")
    assert [e["xid"] for e in found] == [13, 13, 13, 109]
    assert all(e["pid"] is None and e["process"] is None for e in found[:3])
    assert found[0]["message"].startswith("Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0)")
    assert (found[3]["pid"], found[3]["process"]) == (1797828, "pt_main_thread")
    assert (found[3]["action"], found[3]["severity"]) == ("RESET_GPU", "critical")


def test_lines_without_pid() -> None:
    found = events("bumblebee_677_dmesg.log")
    assert [(e["xid"], e["pid"]) for e in found] == [(32, None), (32, None), (31, None)]
    assert found[0]["message"] == "Channel ID 00000000 intr 00004000"


def test_old_driver_format_without_pci_word_and_an_uncatalogued_xid() -> None:
    (old,) = events("pastebin_xJaypMZt_old_format.log")
    assert (old["pci"], old["xid"]) == ("0000:01:00", 3)
    assert old["action"] is None and old["description"] is None
    assert old["severity"] == "warning"


def test_journal_dmesg_and_talos_prefixes() -> None:
    (bus,) = events("open_gpu_kernel_modules_1151_journal.log")
    assert (bus["pci"], bus["xid"], bus["pid"]) == ("0000:2b:00", 79, None)
    mmu = events("chia_gigahorse_301_dmesg.log")[0]
    assert (mmu["xid"], mmu["pid"], mmu["process"]) == (31, 13332, "cuda_plot_k32_v")
    assert mmu["message"].startswith("Ch 00000010, intr 00000000. MMU Fault")
    cleanup = events("open_gpu_kernel_modules_1150_journal.log")
    assert {(e["xid"], e["process"], e["severity"]) for e in cleanup} == {(45, "python3", "info")}
    assert [e["pci"] for e in cleanup] == ["0000:dc:00", "0000:ed:00", "0000:ba:00", "0000:97:00"]


def test_xid_154_carries_the_recovery_the_gpu_needs() -> None:
    (talos,) = events("open_gpu_kernel_modules_446_talos.log")
    assert talos["recovery_action"] == "GPU Reset Required"
    assert (talos["action"], talos["severity"]) == ("RESET_GPU", "critical")
    gsp = events("nvidia_forum_364958_gsp.log")
    assert [e["xid"] for e in gsp] == [120, 154, 62, 154, 45]
    assert gsp[4]["process"] == "VLLM::Worker"


def test_nvlink5_xids_read_fatality_from_the_line() -> None:
    found = events("gpud_1160_1174_nvlink5.log")
    assert [(e["xid"], e["fatal"], e["severity"]) for e in found] == [
        (144, False, "warning"),
        (149, True, "critical"),
        (149, True, "critical"),
        (145, False, "warning"),
    ]
    assert found[2]["pci"] == "0019:01:00"


def test_fallen_off_the_bus_without_an_xid_line_is_not_an_xid() -> None:
    (only,) = events("nvsentinel_155_no_xid.log")
    assert (only["pci"], only["xid"]) == ("0000:44:00", 79)


def test_wrapped_line_keeps_its_first_part() -> None:
    (gala,) = events("nixpkgs_539036_journal_wrapped.log")
    assert (gala["xid"], gala["pid"], gala["process"]) == (13, 1773, ".gala-wrapped")
    assert gala["message"].endswith("Offset 00000000, Data")


def test_kmsg_record_framing_is_ignored() -> None:
    # /dev/kmsg framing (Documentation/ABI/testing/dev-kmsg) around a real message.
    message = (FIXTURES / "ml_engineering_debug_md.log").read_text().strip()
    xid = parse_xid_line(f"4,1227,6789012345,-;{message}")
    assert xid is not None
    assert (xid["pci"], xid["xid"], xid["pid"], xid["action"]) == ("0000:10:1c", 63, 1896, "IGNORE")
    assert xid["message"].startswith("Row Remapper: New row marked for remapping")


def test_events_serialise_to_json() -> None:
    for path in sorted(FIXTURES.glob("*.log")):
        for event in parse_lines("xid", path.read_text().splitlines()):
            json.dumps(event)
            assert event["severity"] in SEVERITIES


@pytest.mark.parametrize(
    "word, expected",
    [
        ("critical", "critical"),
        ("INFO", "info"),
        ("fatal", "critical"),
        (None, "warning"),
        ("odd", "warning"),
    ],
)
def test_event_severity_mapping(word: str | None, expected: str) -> None:
    assert event_severity(word) == expected


def test_random_bytes_yield_nothing_and_never_raise() -> None:
    rng = random.Random(7)
    chunks = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 4096))) for _ in range(200)]
    chunks.append(b"NVRM: Xid (PCI:0000:3b:00): ")  # cut before the number
    chunks.append(b"NVRM: Xid (PCI:0000:3b")
    assert list(parse_lines("xid", chunks)) == []


def test_dispatch() -> None:
    assert PARSE_KINDS == ("nccl", "xid", "ethtool")
    with pytest.raises(ValueError, match="unknown parse kind"):
        parse_lines("dmesg", [])
    assert load_catalog()["xids"]


@pytest.mark.skipif(
    importlib.util.find_spec("agents.parsers.ethtool") is not None,
    reason="the ethtool parser is installed",
)
def test_missing_ethtool_parser_is_a_clear_error() -> None:
    with pytest.raises(ParserUnavailableError, match="ethtool"):
        parse_lines("ethtool", ["NIC statistics:"])


@pytest.mark.skipif(
    importlib.util.find_spec("agents.parsers.ethtool") is None,
    reason="the ethtool parser is not installed",
)
def test_ethtool_kind_dispatches_to_the_ethtool_parser() -> None:
    sample = sorted((FIXTURES.parent / "ethtool").glob("*.txt"))[0]
    found = list(parse_lines("ethtool", sample.read_text().splitlines(keepends=True)))
    assert found and all(e["kind"] == "ethtool" for e in found)
