"""Measure and tune batching on your own model and hardware (``pip install 'batchline[bench]'``).

One load generator (:mod:`batchline.bench.loadgen`: closed and open loops over a ``Target``)
and one set of statistics (:mod:`batchline.bench.stats`) under every bench:

- :func:`run_bench` drives configurations (the no-batching baseline, batchline's defaults, your
  knobs files, a classic timeout batcher, or a server URL) with closed- or open-loop load and
  returns a :class:`BenchResult`; :func:`write_report` turns it into ``report.md`` + PNG plots.
  Every model ``batchline run`` takes is measured (``default``, ``PATH.onnx`` with a task,
  ``module:factory``), loaded by ``load_model`` and batched by ``ModelBatcher`` as ``run`` does.
- :mod:`batchline.bench.generate` (``bench --task generate``): sequential, static and
  continuous batching of one text generator, each a target of the same load generator.
- :func:`tune` is the search (measured points in, knobs out); :func:`run_tune` runs it on the
  real model; :func:`decide` is the verdict on measured trials.

Example::

    from pathlib import Path
    from batchline.bench import BenchOptions, parse_load, run_bench, write_report

    result = run_bench(BenchOptions(loads=parse_load("closed:1,8,32"), duration_s=5))
    write_report(result, Path("report"))

Importing this package loads neither the model nor matplotlib; they load when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports

if TYPE_CHECKING:
    from batchline.bench.loadgen import LoadPoint, PointResult, parse_load, run_point
    from batchline.bench.report import write_report
    from batchline.bench.runner import BenchOptions, BenchResult, TuneOptions, run_bench, run_tune
    from batchline.bench.tune import Decision, TuneResult, decide, tune

__all__ = [
    "BenchOptions",
    "BenchResult",
    "Decision",
    "LoadPoint",
    "PointResult",
    "TuneOptions",
    "TuneResult",
    "decide",
    "parse_load",
    "run_bench",
    "run_point",
    "run_tune",
    "tune",
    "write_report",
]

# Imported on first use: this package needs its extra only when a name is used.
__getattr__ = lazy_exports(
    __name__,
    {
        "BenchOptions": "runner",
        "BenchResult": "runner",
        "Decision": "tune",
        "LoadPoint": "loadgen",
        "PointResult": "loadgen",
        "TuneOptions": "runner",
        "TuneResult": "tune",
        "decide": "tune",
        "parse_load": "loadgen",
        "run_bench": "runner",
        "run_point": "loadgen",
        "run_tune": "runner",
        "tune": "tune",
        "write_report": "report",
    },
)
