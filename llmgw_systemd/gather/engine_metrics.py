"""Reading an engine's progress out of its Prometheus metrics text (pure: text in,
one reading out; the fetch is the probes' job).

prometheus_client's own parser reads the exposition format, so label quoting, escapes,
histogram suffixes and comments are handled as Prometheus does. A sample counts when
its name is one the engine's ProgressSeries names, summed over its labels (one engine
may expose one series per model name or engine index).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from llmgw_systemd.health.progress import ProgressReading
from llmgw_systemd.spec.engines.base import ProgressSeries

# A page larger than this is not parsed: the supervisor must stay bounded whatever an
# engine (or something on its port) sends. vLLM's page for one model is about 60 KiB.
MAX_METRICS_BYTES = 4 * 1024 * 1024


def read_progress(text: str, series: ProgressSeries, taken_at: float) -> ProgressReading:
    """One ProgressReading from a metrics page; an unreadable page, or one without the
    series, gives a reading without values and says why."""
    if len(text) > MAX_METRICS_BYTES:
        return ProgressReading(taken_at, None, None,
                               f"metrics page over {MAX_METRICS_BYTES // 1024} KiB")
    wanted = set(series.steps) | set(series.pending)
    sums: dict[str, float] = {}
    try:
        # the parser is untyped (prometheus_client 0.x); it yields Metric families
        for family in text_string_to_metric_families(text):  # type: ignore[no-untyped-call]
            for sample in family.samples:
                if sample.name in wanted:
                    sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        return ProgressReading(taken_at, None, None, f"metrics page not readable: {exc}")
    missing = [name for name in (*series.steps, *series.pending) if name not in sums]
    if len(missing) == len(wanted):
        return ProgressReading(taken_at, None, None,
                               f"metrics page has none of {', '.join(sorted(wanted))}")
    if any(name in missing for name in series.steps):
        return ProgressReading(taken_at, None, None,
                               f"metrics page lacks {', '.join(missing)}")
    # A pending gauge an engine has not published yet (nothing ever queued) is zero.
    steps = sum(sums.get(name, 0.0) for name in series.steps)
    pending = sum(sums.get(name, 0.0) for name in series.pending)
    return ProgressReading(taken_at, steps, pending)
