"""The live collapse monitor: a training run's metrics in, debounced alerts out.

The reference study's collapse signature (docs/study.md): the training reward falls, the
sampler–trainer KL grows 3× or more, and most episodes end on repeated format errors. The
monitor watches for it step by step, inside the trainer (train/trainer.py) or over a metrics log
(`mismatch monitor FILE`, mismatch/cli/monitor.py), and tells the sinks.

One concept per module, bottom to top:

- `signals`: the monitored signals (`SIGNALS`), what a value is, `Alert`, the `Sink` protocol;
- `rules`: `SignalRule` (how one signal is judged), `default_rules()`, `with_kl_floor()`,
  `MonitorConfig`;
- `episodes`: why an episode ended, and a step's format-error share from its raw episodes;
- `state`: `CollapseMonitor`, the state machine (baselines, persistence, corroboration, debounce);
- `baselines`: baselines taken from a known-good run, to judge a new run from its first steps;
- `sinks`: `TerminalSink`, `JsonlSink`, `open_sinks`; `prometheus`: `PrometheusSink`;
  `webhook`: `WebhookSink` (imported from its module: it loads urllib.request, which a
  `mismatch --help` should not pay for);
- `formats/`: each RL framework's metric logs → the native records (`get_adapter`,
  `RecordReader`);
- `follow`: reading a log as it grows (`tail -F`, trainer_state.json re-reads);
- `summary`: what a monitored run amounted to.
"""

from mismatch.probes.monitor.signals import (SEVERITIES, SIGNALS, Alert, Sink, alert_json,
                                             severity_rank)
from mismatch.probes.monitor.rules import MonitorConfig, SignalRule, default_rules, with_kl_floor
from mismatch.probes.monitor.endings import (FORMAT_ERROR_REASONS, episode_end_reason,
                                              episode_summary)
from mismatch.probes.monitor.state import CollapseMonitor
from mismatch.probes.monitor.follow import (check_log, follow_lines, follow_state, read_records,
                                            reads_state, stop_on_signals)
from mismatch.probes.monitor.baselines import baselines_from, baselines_from_log
from mismatch.probes.monitor.sinks import JsonlSink, TerminalSink, open_sinks, read_alerts
from mismatch.probes.monitor.prometheus import PrometheusSink
from mismatch.probes.monitor.summary import run_summary, sink_problems, summary_line, unreadable

__all__ = [
    "SEVERITIES", "SIGNALS", "Alert", "Sink", "alert_json", "severity_rank",
    "MonitorConfig", "SignalRule", "default_rules", "with_kl_floor",
    "FORMAT_ERROR_REASONS", "episode_end_reason", "episode_summary",
    "CollapseMonitor",
    "check_log", "follow_lines", "follow_state", "read_records", "reads_state", "stop_on_signals",
    "baselines_from", "baselines_from_log",
    "JsonlSink", "TerminalSink", "open_sinks", "read_alerts", "PrometheusSink",
    "run_summary", "sink_problems", "summary_line", "unreadable",
]
