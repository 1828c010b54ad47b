"""``precision = auto`` for Hugging Face image folders: which hosts offer bf16 (pinned on
synthetic flag sets, as the text tests do), the gate on top-1 agreement, the cached answer,
the pinned environment, and (on tiny random-weight folders) the measurement on the gate's
photographs and a job's summary line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from batchline._cpu import host_kind
from batchline.jobs import precision, precision_pictures
from batchline.jobs.precision import (
    AUTO_GATE,
    Choice,
    Figures,
    ModelFacts,
    candidates,
    choose_precision,
    decide,
    model_facts,
)
from batchline.models.config import Knobs
from batchline.models.specs import parse_spec
from tests.jobs.test_precision import AMX, AVX2_ONLY, AVX512_BF16, VNNI_ONLY

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.models.image.conftest import build_folder

PICTURES = ModelFacts(onnx=True, no_int8=precision.NO_IMAGE_INT8, pictures=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("image-folders")
    for family in ("vit", "dinov2", "clip"):
        build_folder(root, family)
    return root


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_every_image_folder_that_reads_pictures_is_offered_bf16_alone(folders: Path) -> None:
    vit = parse_spec(f"{folders}/vit/")
    dinov2 = parse_spec(f"{folders}/dinov2/")
    clip = parse_spec(f"{folders}/clip/")
    zero_shot = clip.with_options(task="classify", labels=("a cat", "a dog"))
    assert model_facts(vit, "classify") == PICTURES
    assert model_facts(dinov2, "embed") == PICTURES
    assert model_facts(clip.with_options(input_kind="image"), "embed") == PICTURES
    assert model_facts(zero_shot, "classify") == PICTURES
    assert model_facts(vit, "predict") is None
    for flags in (AMX, AVX512_BF16):
        offered, left = candidates(host_kind(flags), PICTURES, torch=True)
        assert offered == ["bf16"]
        assert left == {"int8": "int8 quantizes text encoders, not an image folder's towers"}
    for flags in (VNNI_ONLY, AVX2_ONLY):
        offered, left = candidates(host_kind(flags), PICTURES, torch=True)
        assert offered == []
        assert left["bf16"] == "no native bf16 on this CPU (no amx_bf16 or avx512_bf16)"


def test_the_gate_asks_top_1_agreement_of_a_classifier() -> None:
    fp32 = Figures(20.0, top10_overlap=None)
    agrees = Figures(50.0, 0.9999, None, top1_agreement=0.98)
    chosen, why = decide({"fp32": fp32, "bf16": agrees}, unit="pictures")
    assert chosen == "bf16"
    assert why == "bf16 x2.50 fp32 (50 vs 20 pictures/s), cosine 0.99990, top-1 0.980"
    flips = Figures(50.0, 0.9995, None, top1_agreement=0.9)
    chosen, why = decide({"fp32": fp32, "bf16": flips}, unit="pictures")
    assert (chosen, why) == ("fp32", "bf16 misses the gate (top-1 0.900 < 0.95)")
    drifts = Figures(50.0, 0.998, None)  # an embedder: no labels to agree on
    chosen, why = decide({"fp32": fp32, "bf16": drifts}, unit="pictures")
    assert (chosen, why) == ("fp32", "bf16 misses the gate (cosine 0.9980 < 0.999)")
    slow = Figures(21.0, 0.9999, None, top1_agreement=1.0)
    assert decide({"fp32": fp32, "bf16": slow})[0] == "fp32"
    assert AUTO_GATE.top1_agreement == 0.95


@pytest.mark.measure_precision
def test_auto_measures_an_image_folder_once_per_cpu_kind_and_says_why(
    folders: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []

    def measured(spec: object, knobs: Knobs, names: list[str]) -> dict[str, Figures]:
        calls.append(list(names))
        bf16 = Figures(52.0, 0.99994, None, top1_agreement=0.98)
        return {"fp32": Figures(24.0, top10_overlap=None), "bf16": bf16}

    def texts_measured(*args: object) -> dict[str, Figures]:
        raise AssertionError("an image folder is not measured on texts")

    monkeypatch.setattr(precision_pictures, "measure_pictures", measured)
    monkeypatch.setattr(precision, "measure", texts_measured)
    monkeypatch.setattr(precision, "_has_torch", lambda: True)
    vit = parse_spec(f"{folders}/vit/")
    first = choose_precision(vit, Knobs.serving(), task="classify", flags=AMX)
    assert first is not None
    assert (first.precision, first.runtime, first.measured) == ("bf16", "torch", True)
    assert first.reason.startswith(
        "auto on amx: bf16 x2.17 fp32 (52 vs 24 pictures/s), cosine 0.99994, top-1 0.980; "
        "int8: int8 quantizes text encoders, not an image folder's towers; measured 20"
    )
    assert calls == [["fp32", "bf16"]]
    again = choose_precision(vit, Knobs.serving(), task="classify", flags=AMX)
    assert again is not None
    assert again.reason == first.reason + ", cached"
    assert again.figures["bf16"].top1_agreement == 0.98
    assert calls == [["fp32", "bf16"]]  # read, not measured
    # another kind with native bf16 is measured apart; one without it is not measured
    choose_precision(vit, Knobs.serving(), task="classify", flags=AVX512_BF16)
    assert calls == [["fp32", "bf16"], ["fp32", "bf16"]]
    avx2 = choose_precision(vit, Knobs.serving(), task="classify", flags=AVX2_ONLY)
    assert avx2 is not None
    assert (avx2.precision, avx2.runtime, avx2.measured) == ("fp32", "onnxruntime", False)
    assert avx2.reason == (
        "auto on avx2: bf16: no native bf16 on this CPU (no amx_bf16 or avx512_bf16); "
        "int8: int8 quantizes text encoders, not an image folder's towers"
    )
    assert len(calls) == 2
    kept = [json.loads(p.read_text()) for p in (cache / "precision").glob("*.json")]
    assert sorted(k["precision"] for k in kept) == ["bf16", "bf16"]


@pytest.mark.measure_precision
def test_without_torch_or_the_photographs_auto_keeps_fp32_and_says_how_to_get_bf16(
    folders: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dinov2 = parse_spec(f"{folders}/dinov2/")
    monkeypatch.setattr(precision, "_has_torch", lambda: False)
    choice = choose_precision(dinov2, Knobs(), task="embed", flags=AMX)
    assert choice is not None
    assert choice.precision == "fp32"
    assert "bf16: bf16 runs on torch, which is not installed" in choice.reason
    monkeypatch.setattr(precision, "_has_torch", lambda: True)
    monkeypatch.setattr(precision_pictures.importlib.util, "find_spec", lambda name: None)
    choice = choose_precision(dinov2, Knobs(), task="embed", flags=AMX)
    assert choice is not None
    assert choice.precision == "fp32"
    assert (
        "bf16: the gate's photographs ship in scikit-learn and scikit-image, not installed: "
        "pip install scikit-learn scikit-image" in choice.reason
    )


def test_asked_for_and_pinned(folders: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vit = parse_spec(f"{folders}/vit/")
    asked = choose_precision(vit, Knobs(precision="bf16"), task="classify", flags=AVX2_ONLY)
    assert asked == Choice("bf16", "asked for", "torch")
    # the suite pins auto to fp32 (tests/conftest.py); int8 pinned keeps an image folder fp32
    pinned = choose_precision(vit, Knobs(), task="classify", flags=AMX)
    assert pinned == Choice("fp32", "auto, set by BATCHLINE_AUTO_PRECISION")
    monkeypatch.setenv(precision.AUTO_ENV, "int8")
    pinned = choose_precision(vit, Knobs(), task="classify", flags=AMX)
    assert pinned is not None
    assert pinned.precision == "fp32"
    assert pinned.reason == (
        "auto, set by BATCHLINE_AUTO_PRECISION to int8, and int8 quantizes text encoders, "
        "not an image folder's towers"
    )
    monkeypatch.setenv(precision.AUTO_ENV, "bf16")
    pinned = choose_precision(vit, Knobs(), task="classify", flags=AMX)
    assert pinned == Choice("bf16", "auto, set by BATCHLINE_AUTO_PRECISION", "torch")


def test_the_gate_pictures_are_real_photographs_in_four_variants() -> None:
    pytest.importorskip("sklearn")
    pytest.importorskip("skimage")
    pictures = precision_pictures.gate_pictures()
    assert len(pictures) == precision_pictures.GATE_PICTURES
    assert {p.mode for p in pictures} == {"RGB"}
    whole, left, right, mirrored = pictures[:4]
    assert left.size == (whole.size[0] // 2, whole.size[1])
    assert right.size[0] == whole.size[0] - whole.size[0] // 2
    assert np.array_equal(np.asarray(mirrored)[:, ::-1], np.asarray(whole))
    digests = {np.asarray(p).tobytes()[:4096] + bytes(str(p.size), "ascii") for p in pictures}
    assert len(digests) == len(pictures)  # no picture twice


@pytest.mark.parametrize(("family", "task"), [("vit", "classify"), ("dinov2", "embed")])
def test_the_measurement_times_both_and_compares_their_outputs(
    folders: Path, cache: Path, family: str, task: str
) -> None:
    pytest.importorskip("sklearn")
    pytest.importorskip("skimage")
    spec = parse_spec(f"{folders}/{family}/")
    knobs = Knobs(sessions=1, intra_op_threads=1, max_concurrent_batches=1)
    figures = precision_pictures.measure_pictures(spec, knobs, ["fp32", "bf16"])
    assert figures["fp32"].records_per_s > 0
    bf16 = figures["bf16"]
    assert bf16.error == ""
    assert bf16.records_per_s > 0
    assert AUTO_GATE.mean_cosine <= bf16.mean_cosine < 1.0  # bf16's outputs, near fp32's
    assert bf16.top10_overlap is None
    if task == "classify":
        assert bf16.top1_agreement is not None
        assert bf16.top1_agreement >= AUTO_GATE.top1_agreement
    else:
        assert bf16.top1_agreement is None
