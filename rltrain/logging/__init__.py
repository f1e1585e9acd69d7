"""Observability: metric names, stage timers, the metrics logger, a progress bar and run plots.

The metric naming scheme (slash-namespaced ``group/name`` keys of a flat ``dict[str, float]`` per
step) is documented in :mod:`rltrain.logging.metrics`; what a run prints on the console and writes to
its log file, in :mod:`rltrain.logging.console`. Heavy dependencies (TensorBoard,
matplotlib) are imported only when a logger or a plot is created.
"""

from rltrain.logging.metrics import STAGES, length_metrics, summary_stats, throughput_metrics
from rltrain.logging.plot import add_plot_subparser, plot_main, plot_run, read_metrics
from rltrain.logging.progress import StepProgress
from rltrain.logging.timer import StageTimer
from rltrain.logging.tracker import MetricsLogger

__all__ = [
    "STAGES",
    "MetricsLogger",
    "StageTimer",
    "StepProgress",
    "add_plot_subparser",
    "length_metrics",
    "plot_main",
    "plot_run",
    "read_metrics",
    "summary_stats",
    "throughput_metrics",
]
