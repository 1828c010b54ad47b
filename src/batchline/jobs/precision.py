"""Which precision an embedding model, a text classifier or cross-encoder, or an image folder
runs in on this CPU (``Knobs.precision``), for ``run`` and ``serve``: ``fp32`` or ``int8`` on
ONNX Runtime, ``bf16`` on torch (oneDNN), or ``auto``.

``auto`` measures once per model, CPU kind and layout, and keeps the answer under the cache
folder (``precision/``): the first job on a host pays ~10-30 s on 2 cores, later ones read a
file. The measurement:

1. The candidates this host can gain from (:func:`candidates`): fp32 always; int8 where the
   CPU has int8 dot products (AMX-INT8, AVX512-VNNI, AVX-VNNI: ONNX Runtime's int8 kernels use
   them); bf16 where it computes bf16 natively (AMX, AVX512-BF16) and torch is installed and
   the model has weights torch loads. Elsewhere the job says why each was left out.
2. Each candidate is loaded in the job's layout and embeds the first :data:`GATE_TEXTS` texts
   of the demo corpus in length-sorted batches of ``target_batch_tokens``, as many batches
   at once as the job runs, then every second text again; the rounds alternate the
   candidates (fp32, bf16, int8, fp32, ...), so that another process's load hits each alike,
   and a candidate's speed is its better round (model calls only: tokenizing is the same;
   the loop: :mod:`batchline.jobs.precision_measure`).
3. The quality gate (:data:`AUTO_GATE`): a lower precision is kept only where its vectors of the
   gate texts reach a mean cosine of 0.999 to fp32's and their 10 nearest neighbours agree
   at least 95 %.
4. The fastest candidate past the gate wins if it beats fp32 by :data:`MIN_GAIN` (less is
   within the noise of a short measurement); else fp32, with the reason.

A text classifier's or a cross-encoder's folder is measured the same way on the same texts
(a cross-encoder's: pairs of them), bf16 against fp32 (int8 is for embedding models): its
labels' probabilities or its rankings against fp32's by mean cosine, its labels or its best
documents by top-1 agreement (:mod:`batchline.jobs.precision_heads`); a plain ``.onnx``
classifier has no weights torch loads and stays fp32, saying so.

An image folder that reads pictures (a classifier, an image encoder, CLIP's or SigLIP's image
tower, zero-shot) is measured the same way on photographs instead of texts: bf16 against
fp32 only (int8 is for text encoders), its logits or vectors against fp32's by mean cosine,
a classifier's labels by top-1 agreement (:mod:`batchline.jobs.precision_pictures`). The gate
and the choice among measured figures are one for both: :mod:`batchline.jobs.precision_gate`.

What was chosen, and why, is one line (:meth:`Choice.describe`): the load log and the run
summary carry it. ``precision = "fp32" | "bf16" | "int8"`` forces one (``--set
precision=bf16``; ``--quantize int8`` is int8, still refused below its own gate:
:mod:`batchline.jobs.quantized`).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from batchline._cache import cache_dir, write_whole
from batchline._cpu import HostKind, host_kind
from batchline._errors import InputError
from batchline.jobs.precision_gate import AUTO_GATE, MIN_GAIN, Figures, decide
from batchline.jobs.precision_measure import Trial, measure
from batchline.knobs import Preset, machine_cores
from batchline.models.config import Knobs
from batchline.models.specs import ModelSpec

__all__ = [
    "AUTO_ENV",
    "AUTO_GATE",
    "GATE_TEXTS",
    "MIN_GAIN",
    "NO_HEAD_INT8",
    "Choice",
    "Figures",
    "ModelFacts",
    "announce",
    "candidates",
    "choose_precision",
    "decide",
    "measured_choice",
    "model_facts",
    "resolve_knobs",
    "runtime_layout",
]

# the models' logger: run and serve print its INFO lines as the model's load line
logger = logging.getLogger("batchline.models")

#: Demo-corpus texts the candidates embed and the gate compares (their neighbours among them).
GATE_TEXTS = 512
#: An environment variable that sets what ``auto`` resolves to, without measuring (fp32, bf16,
#: int8): CI on hosts of different kinds sets fp32, so that every host computes the same vectors.
AUTO_ENV = "BATCHLINE_AUTO_PRECISION"
#: Bump when the measurement changes, so that older answers are measured again.
PRECISION_VERSION = 1


#: Why a text classifier or a cross-encoder has no int8 candidate.
NO_HEAD_INT8 = "int8 quantizes embedding models; a classifier's or reranker's graph runs fp32"


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a model offers the choice: whether ONNX Runtime runs it (fp32, int8), why torch
    cannot (``no_torch_weights``; empty when it can: bf16), why int8 is not built for it
    (``no_int8``), whether it reads pictures (``pictures``: the gate measures photographs,
    not texts), and what its gate compares (``task``: an embedder's vectors, a classifier's
    labels, a cross-encoder's rankings: :mod:`batchline.jobs.precision_heads`)."""

    onnx: bool
    no_torch_weights: str = ""
    no_int8: str = ""
    pictures: bool = False
    task: str = "embed"


@dataclass(frozen=True)
class Choice:
    """The precision a model loads in, and why (one line: :meth:`describe`). ``measured``:
    the gate was applied to it (an int8 chosen so needs no second gate)."""

    precision: str
    reason: str
    runtime: str = "onnxruntime"
    figures: Mapping[str, Figures] = field(default_factory=dict)
    measured: bool = False
    #: how the runtime's own layout changed the batching knobs nobody gave ("": it did not;
    #: :func:`runtime_layout`)
    layout: str = ""

    def describe(self) -> str:
        said = f"{self.precision} on {self.runtime} ({self.reason})"
        return f"{said}; {self.layout}" if self.layout else said


#: Why an image folder's towers have no int8 candidate.
NO_IMAGE_INT8 = "int8 quantizes text encoders, not an image folder's towers"


def model_facts(spec: ModelSpec, task: str = "embed") -> ModelFacts | None:
    """What ``spec`` offers for ``task``: an embedding model, a text classifier or
    cross-encoder, or an image folder that reads pictures (a classifier too); ``None`` for a
    Python model, a plain ``.onnx`` that reads pictures (no torch weights, no int8 path: it runs
    fp32), or another task."""
    if spec.kind == "python":
        return None
    if _image_folder_pictures(spec, task):
        return ModelFacts(onnx=True, no_int8=NO_IMAGE_INT8, pictures=True)
    if task in ("classify", "score") and _text_onnx(spec):
        no_weights = "" if spec.kind == "hf" else "an .onnx file has no weights torch loads"
        return ModelFacts(onnx=True, no_torch_weights=no_weights, no_int8=NO_HEAD_INT8, task=task)
    if task != "embed" or _embeds_pictures(spec):
        return None
    if spec.kind == "builtin":
        return ModelFacts(onnx=True)
    if spec.kind == "hf" and spec.folder is not None:
        if spec.folder.image is not None:  # CLIP's or SigLIP's text tower
            return ModelFacts(
                onnx=True,
                no_torch_weights="its text tower runs on ONNX Runtime only",
                no_int8=NO_IMAGE_INT8,
            )
        found = spec.folder.for_task("embed")
        if found.decoder:
            return ModelFacts(onnx=False)
        if found.dense:
            return ModelFacts(onnx=True, no_torch_weights="its Dense modules run on ONNX only")
        return ModelFacts(onnx=True)
    return ModelFacts(onnx=True, no_torch_weights="an .onnx file has no weights torch loads")


def _image_folder_pictures(spec: ModelSpec, task: str) -> bool:
    """Whether ``spec`` is a Hugging Face image folder that reads pictures for ``task``: a
    classifier, an image encoder, or a two-tower folder classifying zero-shot or loaded for
    its image tower."""
    kind = spec.folder.image if spec.kind == "hf" and spec.folder is not None else None
    if kind is None or task not in ("embed", "classify"):
        return False
    return kind != "two-tower" or task == "classify" or spec.input_kind == "image"


def _embeds_pictures(spec: ModelSpec) -> bool:
    """Whether ``spec`` embeds pictures: a plain ``.onnx`` told how to read them, an image
    encoder's folder, or a two-tower folder loaded for its image tower."""
    if spec.image is not None:
        return True
    kind = spec.folder.image if spec.folder is not None else None
    return kind is not None and (kind != "two-tower" or spec.input_kind == "image")


def candidates(
    host: HostKind, facts: ModelFacts, *, torch: bool
) -> tuple[list[str], dict[str, str]]:
    """The precisions worth measuring beyond fp32 on ``host`` for a model with ``facts``
    (``torch``: torch and transformers are installed), and why each other one is not."""
    offered: list[str] = []
    left: dict[str, str] = {}
    if not host.bf16:
        left["bf16"] = "no native bf16 on this CPU (no amx_bf16 or avx512_bf16)"
    elif not torch:
        left["bf16"] = "bf16 runs on torch, which is not installed"
    elif facts.no_torch_weights:
        left["bf16"] = f"bf16 runs on torch, and {facts.no_torch_weights}"
    else:
        offered.append("bf16")
    if not facts.onnx:
        left["int8"] = "the model runs on torch, and int8 is ONNX Runtime's"
    elif facts.no_int8:
        left["int8"] = facts.no_int8
    elif not host.int8:
        left["int8"] = "no int8 dot products on this CPU (no amx_int8, avx512_vnni or avx_vnni)"
    else:
        offered.append("int8")
    return offered, left


def choose_precision(
    spec: ModelSpec,
    knobs: Knobs,
    *,
    task: str,
    texts: Callable[[], Sequence[str]] | None = None,
    flags: frozenset[str] | None = None,
) -> Choice | None:
    """The precision ``spec`` loads in with ``knobs`` (``None``: the knob does not apply: a
    Python model, a plain ``.onnx`` that reads pictures, a generator). ``auto`` measures an
    embedding model, a text classifier's or cross-encoder's folder, or an image folder, once
    per model and CPU kind (``texts``: the gate texts, default the demo corpus's; an image
    folder's are photographs; ``flags``: the CPU's)."""
    facts = model_facts(spec, task)
    if facts is None:
        return None
    if knobs.precision != "auto":
        return Choice(knobs.precision, "asked for", _runtime(knobs.precision, facts))
    if knobs.is_gpu:
        return Choice("fp32", f"auto: the choice is made for CPUs, {knobs.device} runs fp32")
    pinned = os.environ.get(AUTO_ENV, "")
    if pinned:
        if pinned not in ("fp32", "bf16", "int8"):
            raise InputError(f"{AUTO_ENV} must be fp32, bf16 or int8, got {pinned!r}")
        cannot = {"int8": facts.no_int8, "bf16": facts.no_torch_weights}.get(pinned, "")
        if cannot:  # pinned for the models that have it: this one keeps fp32
            why = f"auto, set by {AUTO_ENV} to {pinned}, and {cannot}"
            return Choice("fp32", why, _runtime("fp32", facts))
        return Choice(pinned, f"auto, set by {AUTO_ENV}", _runtime(pinned, facts))
    host = host_kind(flags)
    offered, left = candidates(host, facts, torch=_has_torch())
    if facts.pictures and "bf16" in offered:
        from batchline.jobs.precision_pictures import photographs_missing

        missing = photographs_missing()
        if missing:
            offered.remove("bf16")
            left["bf16"] = missing
    skipped = "; ".join(f"{name}: {why}" for name, why in left.items())
    if not offered:
        return Choice("fp32", f"auto on {host.name}: {skipped}", _runtime("fp32", facts))
    return measured_choice(spec, knobs, host, offered, skipped, facts, texts)


def measured_choice(
    spec: ModelSpec,
    knobs: Knobs,
    host: HostKind,
    offered: Sequence[str],
    skipped: str,
    facts: ModelFacts,
    texts: Callable[[], Sequence[str]] | None,
) -> Choice:
    """``auto``'s answer for ``spec`` on ``host`` among fp32 and ``offered``: kept from an
    earlier measurement, else measured now and kept (``skipped``: why the others are not
    candidates, said in the reason)."""
    key = _cache_key(spec, knobs, host, offered, facts)
    cached = _read(key)
    if cached is not None:
        return cached
    names = ["fp32", *offered]
    if facts.pictures:
        from batchline.jobs import precision_pictures

        sample = f"{precision_pictures.GATE_PICTURES} photographs"
    elif facts.task == "score":
        from batchline.jobs.precision_heads import DOCUMENTS, QUERIES

        sample = f"{QUERIES} demo-corpus queries of {DOCUMENTS} documents each"
    else:
        sample = f"{GATE_TEXTS} demo-corpus texts"
    logger.info(
        "%s: measuring fp32 against %s on this CPU, %s, with %s (once per model and CPU kind)",
        spec.name,
        " and ".join(offered),
        host,
        sample,
    )
    start = time.perf_counter()
    gate = _gate_texts if texts is None else texts
    if facts.pictures:
        figures = precision_pictures.measure_pictures(spec, knobs, names)
    elif facts.task == "embed":
        figures = measure(spec, knobs, names, gate)
    else:
        from batchline.jobs import precision_heads

        task = facts.task
        trial = Trial(
            run=lambda model, batch: precision_heads.rows(task, model.run_batch(batch)),
            compare=lambda rate, want, got: precision_heads.compare(task, rate, want, got),
        )
        figures = measure(
            spec, knobs, names, lambda: precision_heads.gate_inputs(task, gate()), trial=trial
        )
    took = time.perf_counter() - start
    chosen, why = decide(figures, unit="pictures" if facts.pictures else "records")
    day = datetime.date.today().isoformat()
    reason = f"auto on {host.name}: {why}" + (f"; {skipped}" if skipped else "")
    reason += f"; measured {day} in {took:.0f} s"
    choice = Choice(chosen, reason, _runtime(chosen, facts), figures, measured=True)
    _write(key, choice)
    return choice


def resolve_knobs(spec: ModelSpec, knobs: Knobs) -> tuple[Knobs, Choice | None]:
    """``knobs`` with ``precision`` as :func:`choose_precision` chooses for ``spec``, and the
    choice (``None``: the knob does not apply to the model; :func:`announce` says it)."""
    from batchline.models.loader import resolve_task

    task = resolve_task(spec)
    choice = choose_precision(spec, knobs, task=task)
    if choice is None:
        return knobs, None
    facts = model_facts(spec, task)
    assert facts is not None  # a choice was made
    return runtime_layout(knobs.replace(precision=choice.precision), choice, facts)


#: An embedding model's batching in bf16 on torch on a CPU, where nobody gave the knobs: one
#: batch in flight more than the cores. torch releases the GIL inside each operator but not
#: between them; a third batch runs while the other two are in Python, so the cores stay busy.
#: ``run`` on 6,000 demo texts, MiniLM, a 2-core AMX Xeon, layouts alternated in one process:
#: x1.04 over one batch per core (x1.02-1.07 across runs; ``benchmarks/bench_embeddings.py
#: --peers`` keeps one batch per core as its control); a fourth batch and 1,024-token batches
#: gained nothing more (docs/precision.md).
TORCH_EXTRA_BATCHES = 1


def runtime_layout(knobs: Knobs, choice: Choice, facts: ModelFacts) -> tuple[Knobs, Choice]:
    """``knobs`` laid out for the runtime ``choice`` runs on, and ``choice`` saying so: a text
    embedding model (``facts``) in bf16 on a CPU's torch runs :data:`TORCH_EXTRA_BATCHES`
    more batches at once than ``max_concurrent_batches``' default, unless a flag, ``--set``, a
    config file or a caller gave it (a :class:`~batchline.knobs.Preset` is a default nobody
    gave)."""
    given = not isinstance(knobs.max_concurrent_batches, Preset)
    text_embedder = facts.task == "embed" and not facts.pictures
    if given or knobs.is_gpu or not text_embedder or choice.precision != "bf16":
        return knobs, choice
    n = knobs.max_concurrent_batches + TORCH_EXTRA_BATCHES
    said = f"{n} batches in flight, torch's layout (--max-concurrent-batches overrides)"
    return knobs.replace(max_concurrent_batches=n), replace(choice, layout=said)


def announce(spec: ModelSpec, choice: Choice | None) -> None:
    """Say in the load log what ``spec`` runs in and why, once it has loaded."""
    if choice is not None:
        logger.info("%s: precision %s", spec.name, choice.describe())


def _runtime(precision: str, facts: ModelFacts) -> str:
    if precision == "bf16" or not facts.onnx:
        return "torch"
    return "onnxruntime"


def _text_onnx(spec: ModelSpec) -> bool:
    """Whether ``spec`` is a text model that ONNX Runtime runs (not a Python one, not an
    image model: those have their own loaders)."""
    if spec.kind not in ("builtin", "onnx", "hf") or spec.image is not None:
        return False
    return spec.folder is None or spec.folder.image is None


def _has_torch() -> bool:
    return all(importlib.util.find_spec(p) is not None for p in ("torch", "transformers"))


def _gate_texts() -> list[str]:
    from batchline.jobs.quantized import gate_texts

    return gate_texts(GATE_TEXTS)


def _cache_key(
    spec: ModelSpec,
    knobs: Knobs,
    host: HostKind,
    offered: Sequence[str],
    facts: ModelFacts | None = None,
) -> str | None:
    """What an answer holds for: the model's files and options, the CPU kind and cores, the
    job's layout, the candidates and the versions that run them; ``None``: not kept."""
    from batchline.models.identity import model_identity

    identity = model_identity(spec)
    if identity is None:
        return None
    layout = [
        knobs.batching,
        knobs.sessions,
        knobs.intra_op_threads,
        knobs.max_concurrent_batches,
        knobs.target_batch_tokens,
        knobs.max_batch_size,
    ]
    versions = [_version(p) for p in ("onnxruntime", "torch", "transformers")]
    data = [identity, str(host), machine_cores(), layout, list(offered), versions]
    data.append(PRECISION_VERSION)
    if facts is not None and facts.task != "embed":  # an embedder's keys stay as they were
        data.append(["head", facts.task])
    if facts is not None and facts.pictures:  # only there: the texts' keys stay as they were
        from batchline.jobs.precision_pictures import PICTURES_VERSION

        data.append(["pictures", PICTURES_VERSION])
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()[:32]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _read(key: str | None) -> Choice | None:
    if key is None:
        return None
    try:
        data = json.loads((cache_dir() / "precision" / f"{key}.json").read_text())
        figures = {k: Figures(**v) for k, v in data["figures"].items()}
        return Choice(
            data["precision"], data["reason"] + ", cached", data["runtime"], figures, True
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(key: str | None, choice: Choice) -> None:
    if key is None:
        return
    data = {
        "precision": choice.precision,
        "reason": choice.reason,
        "runtime": choice.runtime,
        "figures": {k: asdict(v) for k, v in choice.figures.items()},
    }
    try:
        write_whole(
            cache_dir() / "precision" / f"{key}.json", json.dumps(data).encode(), "cache.precision"
        )
    except OSError as exc:  # a read-only cache: measured again next time
        logger.warning("cannot keep the precision measured for this model: %s", exc)
