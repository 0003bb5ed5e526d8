"""scripts/bench_reshape.py: refuses a work directory holding anything before it trains, and tabulates its results."""

import pytest

from fathom.tools.reshape_cost import main, table


def test_a_work_directory_in_use_is_refused_before_anything_runs(tmp_path, capsys):
    (tmp_path / "something").write_text("x")
    with pytest.raises(SystemExit) as stopped:
        main(["--work", str(tmp_path)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"fathom: error: --work {tmp_path}: is not empty; give a new directory\n"
    assert [p.name for p in tmp_path.iterdir()] == ["something"]


def test_the_table_has_a_row_per_direction():
    row = {"reshape": "global_step1 written as 2 stages x 1 replica as 1 stage x 1 replica", "conversion_alone_s": 2.0,
           "conversion_peak_rss": 2**30, "checkpoint_bytes": 2**20, "universal_bytes": 2**19, "resume_launch_s": 9.0,
           "conversion_in_run_s": 3.0, "resume_launch_peak_rss": 2**31}  # fmt: skip
    lines = table({"2_to_1": row, "1_to_2": row}).splitlines()
    assert len(lines) == 4
    assert lines[2].endswith("| 2.0 s | 1,024 MiB | 1 MiB / 0 MiB | 9.0 s (conversion 3.0 s) | 2,048 MiB |")
