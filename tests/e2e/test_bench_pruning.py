"""bench/bench_pruning.py on a tiny setting: its table's rows are the runs asked for, and dropping
half the visual tokens keeps fewer KV bytes than keeping them all (the bench had fallen behind
`prefill_alone`'s messages and `PrefillOutput.handle`, unnoticed: nothing ran it)."""

from __future__ import annotations

import re

from bench.bench_pruning import main


def test_bench_pruning_prints_one_row_per_retention_and_pruning_shrinks_the_kv(capsys, tmp_path):
    code = main(
        ["--frames", "4", "--retain", "1.0", "0.5", "--decode-tokens", "2", "--repeats", "1",
         "--presets", "--work-dir", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    rows = [
        line for line in capsys.readouterr().out.splitlines() if re.match(r"\| 4 \| \d+ \| \d+% \|", line)
    ]
    assert [row.split("|")[3].strip() for row in rows] == ["100%", "50%"]
    kv_bytes = [int(row.split("|")[7].split("(")[0].replace(",", "")) for row in rows]
    assert kv_bytes[1] < kv_bytes[0]
