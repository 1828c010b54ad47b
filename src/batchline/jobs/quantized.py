"""The quality gate of an int8 embedding model (``--quantize int8``), for ``run`` and ``serve``.

A model loaded quantized is compared with its float32 graph on the first 2,000 texts of the
demo corpus (:data:`batchline.models.onnx.quantize.GATE`: mean cosine >= 0.99, top-10
neighbour overlap >= 0.9) before it is used. The figures are kept beside the int8 graph, so the
comparison runs once per graph (~10-60 s on a 2-core CPU), and a model that misses the gate is
refused with the figures and by how much: nothing is ever called "quantized" that is not
measured to be close.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any

from batchline._errors import InputError
from batchline.knobs import machine_cores
from batchline.models.config import Knobs
from batchline.models.onnx import GATE, Quality, cached_quality, measure_quality, store_quality
from batchline.models.specs import ModelSpec

__all__ = ["check_quantized", "describe", "gate_texts"]

logger = logging.getLogger("batchline.jobs")


def gate_texts(count: int) -> list[str]:
    """The first ``count`` texts of the demo corpus (built on first use)."""
    from batchline.datasets.corpus import demo_corpus_path

    with demo_corpus_path().open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in itertools.islice(f, count)]


def check_quantized(model: Any, spec: ModelSpec, knobs: Knobs) -> Quality:
    """``model`` (``spec`` loaded in precision int8) against its float32 graph: the
    figures, measured once per int8 graph; ``InputError`` when they miss the gate."""
    from batchline.models.loader import load_model

    graph = Path(model.embedder.model.path)
    quality = cached_quality(graph)
    if quality is None or quality.texts != GATE.texts:
        logger.info(
            "%s: comparing its int8 graph with float32 on %d demo-corpus texts (once)",
            spec.name,
            GATE.texts,
        )
        one = knobs.replace(
            quantize=None,
            precision="fp32",
            batching=False,
            sessions=1,
            intra_op_threads=machine_cores(),
        )
        reference = load_model(spec, one)
        quick = load_model(spec, one.replace(precision="int8"))
        try:
            quality = measure_quality(reference, quick, gate_texts(GATE.texts))
        finally:
            reference.close()
            quick.close()
        store_quality(graph, quality)
    missed = quality.shortfalls(GATE)
    if missed:
        fix = "run it without --quantize" if knobs.quantize else "use precision auto or fp32"
        raise InputError(
            f"model {spec.name!r} quantized to int8 misses the quality gate on "
            f"{quality.texts} demo-corpus texts: {'; '.join(missed)}; {fix}"
        )
    logger.info(
        "%s: int8, mean cosine %.4f and top-10 overlap %.3f against float32 (gate %s and %s)",
        spec.name,
        quality.mean_cosine,
        quality.top10_overlap,
        GATE.mean_cosine,
        GATE.top10_overlap,
    )
    return quality


def describe(quality: Quality, quantize: str) -> str:
    """``quality`` in one line, for the job's summary."""
    return (
        f"{quantize}: mean cosine {quality.mean_cosine:.4f}, top-10 overlap "
        f"{quality.top10_overlap:.3f} against float32"
    )
