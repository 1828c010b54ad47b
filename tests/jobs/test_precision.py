"""``Knobs.precision``: the host kinds read from CPU flags, the candidates each kind offers, the
choice among measured figures, its cache, and (slow) bf16 and the measurement on the real
default model. The choice logic is pinned on synthetic flag sets, so it holds on every host."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline._cpu import cpu_flags, host_kind
from batchline._errors import InputError
from batchline.jobs import precision
from batchline.jobs.precision import (
    AUTO_GATE,
    Choice,
    Figures,
    ModelFacts,
    candidates,
    choose_precision,
    decide,
    model_facts,
    resolve_knobs,
    runtime_layout,
)
from batchline.knobs import Preset
from batchline.models.config import Knobs
from batchline.models.specs import parse_spec

# Flag sets of the hosts this project meets (the flags that matter, and a few that do not).
BASE = {"fpu", "sse4_2", "avx", "fma"}
AMX = BASE | {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8"}
AVX512_BF16 = BASE | {"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}  # AMD EPYC Genoa
VNNI_ONLY = BASE | {"avx2", "avx512f", "avx512_vnni"}  # Intel Cascade Lake
AVX2_ONLY = BASE | {"avx2"}  # AMD EPYC Rome
ONNX_AND_TORCH = ModelFacts(onnx=True)


@pytest.mark.parametrize(
    ("flags", "kind", "bf16", "int8"),
    [
        (AMX, "amx", True, True),
        (AVX512_BF16, "avx512-bf16", True, True),
        (AVX512_BF16 - {"avx512_vnni"}, "avx512-bf16", True, False),
        (VNNI_ONLY, "vnni", False, True),
        (BASE | {"avx2", "avx_vnni"}, "vnni", False, True),
        (AVX2_ONLY, "avx2", False, False),
        (BASE, "other", False, False),
        (set(), "other", False, False),
    ],
)
def test_each_host_kind_is_read_from_its_flags(
    flags: set[str], kind: str, bf16: bool, int8: bool
) -> None:
    host = host_kind(flags)
    assert (host.name, host.bf16, host.int8) == (kind, bf16, int8)
    assert set(host.found) <= flags
    assert str(host).startswith(kind)


def test_flags_come_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 amx_int8\n")
    assert host_kind(cpu_flags(info)).name == "amx"
    assert host_kind(cpu_flags(tmp_path / "missing")).name == "other"


@pytest.mark.parametrize(
    ("flags", "offered", "left"),
    [
        (AMX, ["bf16", "int8"], []),
        (AVX512_BF16, ["bf16", "int8"], []),
        (VNNI_ONLY, ["int8"], ["bf16"]),
        (AVX2_ONLY, [], ["bf16", "int8"]),
    ],
)
def test_each_host_kind_offers_the_candidates_it_computes_natively(
    flags: set[str], offered: list[str], left: list[str]
) -> None:
    got, why = candidates(host_kind(flags), ONNX_AND_TORCH, torch=True)
    assert got == offered
    assert sorted(why) == left
    if "bf16" in why:
        assert why["bf16"] == "no native bf16 on this CPU (no amx_bf16 or avx512_bf16)"
    if "int8" in why:
        assert "no int8 dot products on this CPU" in why["int8"]


def test_what_the_model_and_the_install_leave_out(tmp_path: Path) -> None:
    amx = host_kind(AMX)
    got, why = candidates(amx, ONNX_AND_TORCH, torch=False)
    assert got == ["int8"]
    assert why["bf16"] == "bf16 runs on torch, which is not installed"
    (tmp_path / "model.onnx").write_bytes(b"")
    onnx_file = model_facts(parse_spec(str(tmp_path / "model.onnx")))
    assert onnx_file is not None
    got, why = candidates(amx, onnx_file, torch=True)
    assert got == ["int8"]
    assert why["bf16"] == "bf16 runs on torch, and an .onnx file has no weights torch loads"
    got, why = candidates(amx, ModelFacts(onnx=False), torch=True)  # a decoder embedder
    assert got == ["bf16"]
    assert "int8 is ONNX Runtime's" in why["int8"]
    assert model_facts(parse_spec("default")) == ModelFacts(onnx=True)
    assert model_facts(parse_spec("mymodule:factory")) is None


def test_the_fastest_past_the_gate_wins_by_a_margin() -> None:
    fast_bf16 = Figures(250.0, mean_cosine=0.99996, top10_overlap=0.99)
    sloppy_int8 = Figures(500.0, mean_cosine=0.9924, top10_overlap=0.91)
    chosen, why = decide({"fp32": Figures(100.0), "bf16": fast_bf16, "int8": sloppy_int8})
    assert chosen == "bf16"
    assert "bf16 x2.50 fp32 (250 vs 100 records/s), cosine 0.99996, top-10 0.990" in why
    assert "int8 misses the gate (cosine 0.9924 < 0.999, top-10 0.910 < 0.95)" in why
    good_int8 = Figures(300.0, mean_cosine=0.9995, top10_overlap=0.97)
    assert decide({"fp32": Figures(100.0), "bf16": fast_bf16, "int8": good_int8})[0] == "int8"
    # within the noise of a short measurement: fp32 stays
    chosen, why = decide({"fp32": Figures(100.0), "bf16": Figures(105.0)})
    assert chosen == "fp32"
    assert why.endswith("none faster than fp32 by x1.10")
    # a candidate that failed is out, with its error
    broken = Figures(error="did not load: no torch")
    chosen, why = decide({"fp32": Figures(100.0), "bf16": broken})
    assert (chosen, why) == ("fp32", "bf16 misses the gate (did not load: no torch)")
    assert decide({"fp32": Figures(100.0)}) == ("fp32", "no other candidate")


@pytest.mark.measure_precision
def test_choose_asks_nothing_where_there_is_nothing_to_measure() -> None:
    default = parse_spec("default")
    forced = choose_precision(default, Knobs(precision="bf16"), task="embed", flags=AVX2_ONLY)
    assert forced == Choice("bf16", "asked for", "torch")
    assert forced.describe() == "bf16 on torch (asked for)"
    gpu = choose_precision(default, Knobs(device="cuda"), task="embed", flags=AMX)
    assert gpu is not None
    assert gpu.precision == "fp32"
    avx2 = choose_precision(default, Knobs(), task="embed", flags=AVX2_ONLY)
    assert avx2 is not None
    assert avx2.precision == "fp32"
    assert not avx2.measured
    assert avx2.reason.startswith("auto on avx2: bf16: no native bf16 on this CPU")
    assert "int8: no int8 dot products" in avx2.reason


@pytest.mark.parametrize("task", ["classify", "score"])
@pytest.mark.parametrize("pinned", ["", "bf16", "int8"])
def test_auto_keeps_an_onnx_classifier_or_reranker_in_fp32_and_says_why(
    task: str, pinned: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # a plain .onnx has no weights torch loads, and int8 is for embedding models: nothing to
    # measure, whatever the host and whatever CI pins auto to
    if pinned:
        monkeypatch.setenv(precision.AUTO_ENV, pinned)
    else:
        monkeypatch.delenv(precision.AUTO_ENV, raising=False)
    monkeypatch.setattr(precision, "measure", _no_measuring)
    graph = tmp_path / "model.onnx"
    graph.write_bytes(b"")  # the choice reads the spec, not the file
    spec = parse_spec(str(graph)).with_options(task=task)
    choice = choose_precision(spec, Knobs(), task=task, flags=AMX)
    assert choice is not None
    assert choice.precision == "fp32"
    assert choice.runtime == "onnxruntime"
    assert not choice.measured
    if pinned == "bf16":
        assert "an .onnx file has no weights torch loads" in choice.reason
    elif pinned == "int8":
        assert precision.NO_HEAD_INT8 in choice.reason
    else:
        assert choice.reason.startswith("auto on amx: bf16: bf16 runs on torch, and an .onnx")
        assert f"int8: {precision.NO_HEAD_INT8}" in choice.reason
    # asked for: fp32 loads; bf16 is the loader's to refuse for a file
    forced = choose_precision(spec, Knobs(precision="fp32"), task=task, flags=AMX)
    assert forced == Choice("fp32", "asked for", "onnxruntime")
    # a Python model and a generator have no precision to choose
    assert choose_precision(parse_spec("json:dumps"), Knobs(), task=task, flags=AMX) is None
    assert choose_precision(spec, Knobs(), task="generate", flags=AMX) is None


def _no_measuring(*args: object, **kwargs: object) -> dict[str, Figures]:
    raise AssertionError("nothing to measure here")


@pytest.mark.parametrize("task", ["classify", "score"])
def test_a_classifier_or_reranker_folder_is_measured_on_its_own_outputs(
    task: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The measurement itself, not a stand-in: both candidates run the gate's texts or pairs,
    and bf16's labels or scores are compared with fp32's (the heads' figures, no neighbours)."""
    pytest.importorskip("torch")
    from tests.models.hf.conftest import save_bert

    monkeypatch.delenv(precision.AUTO_ENV, raising=False)
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    folder = save_bert(tmp_path / task, labels=3 if task == "classify" else 1)
    spec = parse_spec(f"{folder}/").with_options(task=task)
    texts = [f"the cat sat on the mat {i} times" for i in range(48)]
    knobs = Knobs(sessions=1, intra_op_threads=1, max_concurrent_batches=1)
    choice = choose_precision(spec, knobs, task=task, texts=lambda: texts, flags=AMX)
    assert choice is not None
    assert choice.measured
    fp32, bf16 = choice.figures["fp32"], choice.figures["bf16"]
    assert fp32.records_per_s > 0
    assert (bf16.error, bf16.top10_overlap) == ("", None)
    assert bf16.records_per_s > 0
    assert bf16.mean_cosine is not None
    assert 0.9 < bf16.mean_cosine <= 1.0
    assert bf16.top1_agreement is not None


@pytest.mark.parametrize("task", ["classify", "score"])
def test_auto_measures_a_classifier_or_reranker_folder_in_bf16_on_a_bf16_host(
    task: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A folder is offered bf16 (torch) and measured on the gate's texts or pairs; int8 is
    left out with its reason; the figures decide, and the answer is kept."""
    pytest.importorskip("torch")
    from tests.models.hf.conftest import save_bert

    monkeypatch.delenv(precision.AUTO_ENV, raising=False)
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    folder = save_bert(tmp_path / task, labels=3 if task == "classify" else 1)
    spec = parse_spec(f"{folder}/").with_options(task=task)
    calls: list[tuple[list[str], list[object]]] = []

    def measured(_spec: object, _knobs: object, names: Any, inputs: Any, **kw: Any) -> Any:
        calls.append((list(names), list(inputs())))
        slow = Figures(100.0, top10_overlap=None)
        return {"fp32": slow, "bf16": Figures(250.0, 0.9999, None, top1_agreement=1.0)}

    monkeypatch.setattr(precision, "measure", measured)
    texts = [f"text number {i}" for i in range(60)]
    choice = choose_precision(spec, Knobs(), task=task, texts=lambda: texts, flags=AMX)
    assert choice is not None
    assert choice.measured
    assert (choice.precision, choice.runtime) == ("bf16", "torch")
    assert f"int8: {precision.NO_HEAD_INT8}" in choice.reason
    assert "bf16 x2.50 fp32" in choice.reason
    assert "top-1 1.000" in choice.reason
    ((names, inputs),) = calls
    assert names == ["fp32", "bf16"]
    if task == "classify":
        assert inputs == texts
    else:  # 32 queries x 16 documents, each query's documents the texts after it
        assert len(inputs) == 32 * 16
        assert inputs[0] == [texts[0], texts[1]]
        assert inputs[16] == [texts[1], texts[2]]
    again = choose_precision(spec, Knobs(), task=task, texts=lambda: texts, flags=AMX)
    assert again is not None
    assert again.precision == "bf16"
    assert len(calls) == 1


def test_the_heads_gate_compares_labels_and_rankings() -> None:
    from batchline.jobs import precision_heads

    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]], np.float32)
    same = precision_heads.compare("classify", 10.0, probs, probs)
    assert same.misses(AUTO_GATE) == ""
    assert same.top1_agreement == 1.0
    flipped = precision_heads.compare("classify", 10.0, probs, probs[:, ::-1].copy())
    assert "top-1 0.000" in flipped.misses(AUTO_GATE)
    # scores: one query of 16 documents; a shifted copy ranks alike, a reversed one does not
    scores = np.linspace(0.1, 0.9, 16, dtype=np.float32).reshape(16, 1)
    shifted = precision_heads.compare("score", 10.0, scores, scores + 0.05)
    assert shifted.mean_cosine == pytest.approx(1.0)
    assert shifted.top1_agreement == 1.0
    reversed_ = precision_heads.compare("score", 10.0, scores, scores[::-1].copy())
    assert reversed_.mean_cosine == pytest.approx(-1.0)
    assert reversed_.misses(AUTO_GATE)
    flat = np.full((16, 1), 0.5, np.float32)
    assert precision_heads.compare("score", 10.0, flat, flat).mean_cosine == 1.0
    assert precision_heads.compare("score", 10.0, flat, scores).mean_cosine == 0.0


@pytest.mark.measure_precision
def test_auto_measures_once_per_model_and_cpu_kind_then_reads_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path))
    calls: list[list[str]] = []

    def measured(spec: object, knobs: Knobs, names: list[str], texts: object) -> dict[str, Figures]:
        calls.append(list(names))
        return {
            "fp32": Figures(100.0),
            "bf16": Figures(230.0, 0.99995, 0.99),
            "int8": Figures(400.0, 0.992, 0.9),
        }

    monkeypatch.setattr(precision, "measure", measured)
    monkeypatch.setattr(precision, "_has_torch", lambda: True)
    spec = parse_spec("default")
    first = choose_precision(spec, Knobs(sessions=2), task="embed", flags=AMX)
    assert first is not None
    assert (first.precision, first.runtime, first.measured) == ("bf16", "torch", True)
    assert first.reason.startswith("auto on amx: bf16 x2.30 fp32")
    assert " measured 20" in first.reason
    assert calls == [["fp32", "bf16", "int8"]]
    again = choose_precision(spec, Knobs(sessions=2), task="embed", flags=AMX)
    assert again is not None
    assert calls == [["fp32", "bf16", "int8"]]  # read, not measured
    assert again.precision == "bf16"
    assert again.reason == first.reason + ", cached"
    assert again.figures == first.figures
    # another CPU kind, or another layout, is measured apart
    choose_precision(spec, Knobs(sessions=2), task="embed", flags=VNNI_ONLY)
    choose_precision(spec, Knobs(sessions=1), task="embed", flags=AMX)
    assert calls[1:] == [["fp32", "int8"], ["fp32", "bf16", "int8"]]
    kept = list((tmp_path / "precision").glob("*.json"))
    assert len(kept) == 3
    assert json.loads(kept[0].read_text())["figures"]["fp32"]["records_per_s"] == 100.0


def test_the_suite_pins_auto_to_fp32_where_it_would_measure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    choice = choose_precision(parse_spec("default"), Knobs(), task="embed", flags=AMX)
    assert choice == Choice("fp32", "auto, set by BATCHLINE_AUTO_PRECISION")
    monkeypatch.setenv("BATCHLINE_AUTO_PRECISION", "bf16")
    choice = choose_precision(parse_spec("default"), Knobs(), task="embed", flags=AVX2_ONLY)
    assert choice is not None
    assert (choice.precision, choice.runtime) == ("bf16", "torch")
    monkeypatch.setenv("BATCHLINE_AUTO_PRECISION", "fp16")
    with pytest.raises(InputError, match="BATCHLINE_AUTO_PRECISION must be fp32, bf16 or int8"):
        choose_precision(parse_spec("default"), Knobs(), task="embed", flags=AMX)


def test_the_knob_and_its_older_int8_spelling() -> None:
    assert Knobs().precision == "auto"
    assert Knobs(quantize="int8").precision == "int8"
    assert Knobs(precision="int8").quantize is None
    with pytest.raises(InputError, match="precision must be one of auto, fp32, bf16, int8"):
        Knobs(precision="fp16")
    with pytest.raises(InputError, match="quantize=int8 and precision=bf16 disagree"):
        Knobs(quantize="int8", precision="bf16")


def test_bf16_on_torch_runs_one_batch_more_where_nobody_gave_the_count() -> None:
    bf16 = Choice("bf16", "asked for", "torch")
    text = ModelFacts(onnx=True)
    knobs, choice = runtime_layout(Knobs(max_concurrent_batches=Preset(2)), bf16, text)
    assert knobs.max_concurrent_batches == 3
    assert not isinstance(knobs.max_concurrent_batches, Preset)  # laid out once, not again
    assert choice.describe() == (
        "bf16 on torch (asked for); 3 batches in flight, torch's layout "
        "(--max-concurrent-batches overrides)"
    )
    assert runtime_layout(knobs, choice, text)[0].max_concurrent_batches == 3
    # a count somebody gave is kept, and so is every other runtime's, model's and device's
    for knobs, choice, facts in [
        (Knobs(max_concurrent_batches=2), bf16, text),
        (Knobs(), Choice("fp32", "asked for"), text),
        (Knobs(), Choice("int8", "asked for"), text),
        (Knobs(), bf16, ModelFacts(onnx=True, task="classify")),
        (Knobs(), bf16, ModelFacts(onnx=True, pictures=True)),  # measured for texts only
        (Knobs(device="cuda"), bf16, text),
    ]:
        assert runtime_layout(knobs, choice, facts) == (knobs, choice)


def test_resolving_a_forced_bf16_embedder_lays_it_out_for_torch() -> None:
    knobs, choice = resolve_knobs(parse_spec("default"), Knobs(precision="bf16"))
    assert choice is not None
    assert choice.runtime == "torch"
    assert knobs.max_concurrent_batches == Knobs().max_concurrent_batches + 1
    given = Knobs(precision="bf16", max_concurrent_batches=2)
    assert resolve_knobs(parse_spec("default"), given)[0].max_concurrent_batches == 2


def test_a_default_count_is_a_preset_and_every_given_one_is_plain(tmp_path: Path) -> None:
    import pickle

    from batchline.__main__ import build_parser
    from batchline.jobs.cli import _knobs

    knobs = Knobs()
    assert isinstance(knobs.max_concurrent_batches, Preset)
    assert isinstance(knobs.replace(precision="bf16").max_concurrent_batches, Preset)
    assert isinstance(pickle.loads(pickle.dumps(knobs)).max_concurrent_batches, Preset)  # Ray
    assert knobs == Knobs(max_concurrent_batches=knobs.max_concurrent_batches + 0)
    assert type(Knobs.load(knobs.dump(tmp_path / "k.json")).max_concurrent_batches) is int
    parser = build_parser()
    for argv in (
        ["--max-concurrent-batches", "2"],
        ["--set", "max_concurrent_batches=2"],
        ["--sessions", "2"],
    ):
        count = _knobs(parser.parse_args(["run", *argv])).max_concurrent_batches
        assert (count, type(count)) == (2, int), argv
    assert isinstance(_knobs(parser.parse_args(["run"])).max_concurrent_batches, Preset)


def test_bf16_and_int8_are_cached_apart_from_fp32() -> None:
    from batchline.models.identity import model_identity

    spec = parse_spec("default")
    ids = {p: model_identity(spec, Knobs(precision=p)) for p in ("fp32", "bf16", "int8")}
    assert len(set(ids.values())) == 3
    assert model_identity(spec, Knobs(quantize="int8")) == ids["int8"]


def test_bf16_is_refused_for_other_tasks_and_for_an_onnx_file(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    from batchline.models.loader import load_model
    from tests.jobs.test_quantize import _tiny_predictor

    predictor = tmp_path / "tiny.onnx"
    _tiny_predictor(predictor)
    spec = parse_spec(str(predictor)).with_options(task="predict")
    with pytest.raises(InputError, match="bf16 applies to embedding, classify and score models"):
        load_model(spec, Knobs(precision="bf16"))
    as_embedder = parse_spec(str(predictor)).with_options(task="embed")
    with pytest.raises(InputError, match=r"an \.onnx file has none torch can load"):
        load_model(as_embedder, Knobs(precision="bf16"))


@pytest.mark.slow
def test_a_job_in_bf16_gives_fp32_s_vectors_within_the_gate(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from batchline.datasets.sinks import read_arrays
    from batchline.jobs.run import RunOptions, run

    texts = [f"Record {i}: batching keeps the device busy and loses nothing." for i in range(12)]
    texts += ["A short one.", "Ünïcödé text is fine too — and so are emoji 🙂."]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    rows = {}
    for name in ("fp32", "bf16"):
        knobs = Knobs(sessions=1, precision=name, max_concurrent_batches=Preset(2))
        summary = run(RunOptions(input=data, output=tmp_path / name, knobs=knobs))
        assert summary.records == len(texts)
        rows[name] = dict(summary.rows())
    assert rows["bf16"]["precision"].startswith("bf16 on torch (asked for); 3 batches in flight")
    assert rows["fp32"]["precision"] == "fp32 on onnxruntime (asked for)"
    a, b = read_arrays(tmp_path / "fp32"), read_arrays(tmp_path / "bf16")
    cosine = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cosine.min() >= AUTO_GATE.mean_cosine
    assert not np.array_equal(a, b)  # it did run in bf16


@pytest.mark.slow
@pytest.mark.measure_precision
def test_the_measurement_on_the_real_model_times_each_and_gates_bf16(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    texts = [f"Text {i} about {'batching ' * (i % 7)}and vectors." for i in range(24)]
    with caplog.at_level("INFO", logger="batchline.models"):
        figures = precision.measure(
            parse_spec("default"), Knobs(sessions=1), ["fp32", "bf16"], lambda: texts
        )
        # the candidates' own load lines are not said: the job's load says its one after
        assert "-> torch (bf16)" not in caplog.text
        logging.getLogger("batchline.models").info("said after the measurement")
    assert "said after the measurement" in caplog.text  # the filter went with it
    assert set(figures) == {"fp32", "bf16"}
    assert figures["fp32"].records_per_s > 0
    assert figures["bf16"].records_per_s > 0
    assert figures["bf16"].error == ""
    assert figures["bf16"].misses(AUTO_GATE) == ""
    assert figures["bf16"].mean_cosine < 1.0  # bf16's vectors, not fp32's again


@pytest.mark.slow
def test_serve_loads_the_precision_asked_for() -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("torch")
    from batchline.server.app import _default_loader

    load = _default_loader()
    model = load(parse_spec("emb=default"), Knobs.serving(sessions=1, precision="bf16"))
    try:
        assert type(model).__name__ == "TorchEmbedder"
        assert (model.info.task, model.info.name) == ("embed", "emb")
    finally:
        model.close()
    plain = load(parse_spec("emb=default"), Knobs.serving(sessions=1))  # auto: pinned to fp32
    try:
        assert type(plain).__name__ == "TextEmbedder"
    finally:
        plain.close()


def test_serve_says_why_a_classifier_stays_fp32(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("onnxruntime")
    from batchline.server.app import _default_loader
    from tests.models.onnx_builders import text_classifier

    files = text_classifier(tmp_path)
    spec = parse_spec(f"sentiment={files.model}").with_options(task="classify")
    with caplog.at_level("INFO", logger="batchline.models"):
        model = _default_loader()(spec, Knobs.serving(sessions=1))
    try:
        assert model.info.task == "classify"
    finally:
        model.close()
    said = f"sentiment: precision fp32 on onnxruntime (auto, set by {precision.AUTO_ENV}"
    assert said in caplog.text


def test_a_plain_onnx_reading_pictures_has_no_precision_to_choose(tmp_path: Path) -> None:
    """A plain ``.onnx`` that reads pictures has no weights torch loads and no int8 path: it
    loads in fp32 with no choice (an image folder's choice: tests/jobs/test_precision_pictures.py);
    a two-tower folder's text tower is offered neither bf16 nor int8."""
    pytest.importorskip("torch")
    from batchline.models.image import ImageOptions
    from tests.models.image.conftest import build_folder

    (tmp_path / "emb.onnx").write_bytes(b"")
    onnx_pictures = parse_spec(str(tmp_path / "emb.onnx")).with_options(image=ImageOptions(224))
    assert model_facts(onnx_pictures) is None
    assert choose_precision(onnx_pictures, Knobs(), task="embed", flags=AMX) is None
    clip = parse_spec(f"{build_folder(tmp_path, 'clip')}/")
    texts = model_facts(clip)  # its text tower: texts, as the gate's
    assert texts is not None
    assert not texts.pictures
    offered, left = candidates(host_kind(AMX), texts, torch=True)
    assert offered == []
    assert left["bf16"] == "bf16 runs on torch, and its text tower runs on ONNX Runtime only"
    assert left["int8"] == precision.NO_IMAGE_INT8
    assert model_facts(clip.with_options(input_kind="image")) == ModelFacts(
        onnx=True, no_int8=precision.NO_IMAGE_INT8, pictures=True
    )
