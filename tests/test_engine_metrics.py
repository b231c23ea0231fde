"""An engine's progress read out of its metrics page (gather.engine_metrics), on
pages as the engines serve them. tests/cases/metrics/vllm-0.32.0-*.txt were read from the
real vLLM 0.32.0 CPU build (the tiny model, float32): idle after one 5-token completion,
and working with three 200-token completions in flight. The SGLang page is written by
hand in its shape (no SGLang runs here; the file says where the names come from)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw_systemd.gather.engine_metrics import MAX_METRICS_BYTES, read_progress
from llmgw_systemd.spec.engines import sglang, vllm
from llmgw_systemd.spec.engines.base import ProgressSeries

PAGES = Path(__file__).parent / "cases" / "metrics"
MINE = ProgressSeries("/metrics", ("steps_total",), ("running", "waiting"))


@pytest.mark.parametrize(("page", "series", "steps", "pending"), [
    ("vllm-0.32.0-idle.txt", vllm.PROGRESS, 5, 0),
    ("vllm-0.32.0-working.txt", vllm.PROGRESS, 156, 3),
    ("sglang-0.5.23-working.txt", sglang.PROGRESS, 592, 3),
])
def test_a_page_as_the_engine_serves_it(page: str, series: ProgressSeries, steps: float,
                                        pending: float) -> None:
    reading = read_progress((PAGES / page).read_text(), series, 7.0)
    assert (reading.steps, reading.pending, reading.error) == (steps, pending, "")
    assert reading.taken_at == 7.0 and reading.readable


@pytest.mark.parametrize(("text", "error"), [
    ("<html>not found</html>\n", "metrics page not readable"),
    ("other_metric 1\n", "metrics page has none of running, steps_total, waiting"),
    ("running 1\nwaiting 0\n", "metrics page lacks steps_total"),
    ("steps_total{a=\"x\" 1\n", "metrics page not readable"),
    ("x" * (MAX_METRICS_BYTES + 1), "metrics page over 4096 KiB"),
])
def test_a_page_that_says_nothing_is_no_reading(text: str, error: str) -> None:
    reading = read_progress(text, MINE, 1.0)
    assert not reading.readable and reading.steps is None and reading.pending is None
    assert error in reading.error, reading.error


def test_labels_are_summed_and_a_missing_gauge_is_zero() -> None:
    text = 'steps_total{rank="0"} 10\nsteps_total{rank="1"} 5\nrunning 2\n'
    reading = read_progress(text, MINE, 0.0)
    assert (reading.steps, reading.pending) == (15, 2)
