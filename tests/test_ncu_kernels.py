"""bench.ncu_kernels on the CPU: its ncu command line, the parsing of ncu's raw CSV and the per-kernel summary."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.ncu_kernels import format_table, main, ncu_command, parse_raw_csv, summarize

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
HEADER = ["ID", "Process ID", "Kernel Name", "gpu__time_duration.sum",
          "sm__throughput.avg.pct_of_peak_sustained_elapsed",
          "dram__throughput.avg.pct_of_peak_sustained_elapsed", "sm__warps_active.avg.pct_of_peak_sustained_active",
          "launch__registers_per_thread", "launch__waves_per_multiprocessor",
          "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
          STALL.format("long_scoreboard"), STALL.format("barrier"), STALL.format("wait"), STALL.format("mio_throttle")]
UNITS = ["", "", "", "usecond", "%", "%", "%", "register/thread", "", "%"] + ["cycle/instruction"] * 4
LAUNCHES = [  # kernel, us, sm%, dram%, occupancy%, registers, waves, tensor%, stalls (long_sb, barrier, wait, mio)
    ("chunk_fwd_h", "300", "20", "10", "12.5", "168", "0.48", "3.5", ("9.0", "2.0", "1.0", "0.5")),
    ("chunk_fwd_h", "100", "40", "30", "12.5", "168", "0.48", "7.5", ("5.0", "6.0", "1.0", "0.5")),
    ("wy_bwd", "600", "55", "5", "25.0", "96", "1.94", "", ("1.0", "0.5", "4.0", "3.0")),
]


def raw_csv() -> str:
    """A raw-page CSV as ncu writes it to --log-file: progress lines, the metric names, the units, one row a launch."""
    def line(cells: list[str]) -> str:
        return ",".join(f'"{c}"' for c in cells)

    rows = [line(HEADER), line(UNITS)]
    for i, (name, us, sm, dram, occ, regs, waves, tc, stalls) in enumerate(LAUNCHES):
        rows.append(line([str(i), "4242", name, us, sm, dram, occ, regs, waves, tc, *stalls]))
    return "==PROF== Connected to process 4242\n" + "\n".join(rows) + "\n==PROF== Disconnected from process 4242\n"


def test_the_raw_csv_becomes_one_record_a_launch() -> None:
    launches = parse_raw_csv(raw_csv())
    assert [r["kernel"] for r in launches] == ["chunk_fwd_h", "chunk_fwd_h", "wy_bwd"]
    first = launches[0]
    assert first["duration_us"] == 300.0 and first["sm_pct"] == 20.0 and first["dram_pct"] == 10.0
    assert first["achieved_occupancy_pct"] == 12.5 and first["registers"] == 168 and first["waves_per_sm"] == 0.48
    assert first["tensor_pct"] == 3.5 and first["memory_pct"] is None  # a metric ncu did not report stays None
    assert first["stalls"] == {"long_scoreboard": 9.0, "barrier": 2.0, "wait": 1.0, "mio_throttle": 0.5}
    assert launches[2]["tensor_pct"] is None  # an empty cell is no value


def test_durations_are_microseconds_whatever_unit_ncu_chose() -> None:
    text = raw_csv().replace('"usecond"', '"nsecond"', 1)
    assert [r["duration_us"] for r in parse_raw_csv(text)] == [0.3, 0.1, 0.6]


def test_the_summary_weights_by_duration_and_ranks_kernels_and_stalls() -> None:
    rows = summarize(parse_raw_csv(raw_csv()))
    assert [r["kernel"] for r in rows] == ["wy_bwd", "chunk_fwd_h"]  # by total duration: 600 against 400 us
    wy, h = rows
    assert (h["launches"], h["duration_us"], h["share"]) == (2, 400.0, 0.4)
    assert h["sm_pct"] == pytest.approx((300 * 20 + 100 * 40) / 400)  # weighted by each launch's duration
    assert h["tensor_pct"] == pytest.approx((300 * 3.5 + 100 * 7.5) / 400)
    assert [k for k, _ in h["top_stalls"]] == ["long_scoreboard", "barrier", "wait"]
    assert h["top_stalls"][0][1] == pytest.approx((300 * 9 + 100 * 5) / 400)
    assert [k for k, _ in wy["top_stalls"]] == ["wait", "mio_throttle", "long_scoreboard"]
    assert wy["tensor_pct"] is None and wy["share"] == 0.6
    table = format_table("kdn_diag", rows)
    assert table.splitlines()[0] == "kdn_diag: 1.00 ms of kernels in one forward + backward"
    assert "long_scoreboard 8.0" in table and "60.0%" in table


def test_a_log_without_the_header_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="no ncu raw CSV in the log"):
        parse_raw_csv("==PROF== Connected to process 1\n==PROF== Disconnected from process 1\n")


def test_ncu_profiles_the_childs_range_and_leaves_the_clocks_alone(tmp_path: Path) -> None:
    cmd = ncu_command("/usr/bin/ncu", tmp_path / "x.csv", ["python", "-m", "bench.ncu_kernels", "--child", "kda"])
    assert cmd[0] == "/usr/bin/ncu" and cmd[-5:] == ["python", "-m", "bench.ncu_kernels", "--child", "kda"]
    joined = " ".join(cmd)
    assert "--clock-control none" in joined and "--profile-from-start off" in joined
    assert "--page raw --csv" in joined and f"--log-file {tmp_path / 'x.csv'}" in joined
    assert "--section WarpStateStats" in joined and "--section SpeedOfLight" in joined


def test_a_missing_ncu_is_one_line_naming_the_fix() -> None:
    with pytest.raises(SystemExit, match="'no-such-ncu' is not on PATH; install Nsight Compute or pass --ncu PATH"):
        main(["--ncu", "no-such-ncu", "--mixers", "kda"])
