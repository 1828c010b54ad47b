"""``precision = "auto"`` for an image folder: bf16 on torch measured against fp32 on ONNX
Runtime on real photographs (:mod:`batchline.jobs.precision` makes the choice, keeps it and
says why; this module measures).

The gate's pictures (:func:`gate_pictures`): the photographs that ship in scikit-learn
(``load_sample_images``: a temple in China, a flower) and in scikit-image (``skimage.data``:
an astronaut, coffee, a cat, a rocket, a galaxy field, a stained tissue, a retina, a
motorcycle, and three grey ones), each whole, its left and right halves, and mirrored:
:data:`GATE_PICTURES` pictures, cropped and resized by the model's own preprocessing.

Each candidate runs them in batches the size the job's budget makes (``target_batch_tokens``
read as pictures: :data:`~batchline.models.image.PICTURE_TOKENS` tokens each, at most
``max_batch_size``), as many at once as the job runs, after one batch to warm up; then every
second picture again, the rounds alternating the candidates; a candidate's speed is its
better round. Its outputs are compared with fp32's: the logits of a classifier (zero-shot:
its labels' logits), the vectors of an embedder, by mean cosine; a classifier's labels too,
by top-1 agreement (:data:`~batchline.jobs.precision_gate.AUTO_GATE`).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from batchline._errors import BatchlineError
from batchline.jobs.precision_gate import Figures
from batchline.models.config import Knobs
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from PIL import Image

__all__ = [
    "GATE_PICTURES",
    "PICTURES_VERSION",
    "gate_pictures",
    "measure_pictures",
    "photographs_missing",
]

#: scikit-image's photographs the gate takes (``skimage.data`` names), colour then grey.
_SKIMAGE_PHOTOS = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "camera",
    "coins",
    "moon",
)
#: Each photograph gives this many pictures: whole, its two halves, mirrored.
_VARIANTS = 4
#: The gate's pictures: scikit-learn's two photographs and scikit-image's, in four variants.
GATE_PICTURES = (2 + len(_SKIMAGE_PHOTOS) + 1) * _VARIANTS
#: Bump when the pictures or the measurement change, so that older answers are measured again.
PICTURES_VERSION = 1


def photographs_missing() -> str:
    """Why the gate's photographs cannot be read here ("" when they can): they ship in
    scikit-learn and scikit-image."""
    missing = [
        name
        for name, module in (("scikit-learn", "sklearn"), ("scikit-image", "skimage"))
        if importlib.util.find_spec(module) is None
    ]
    if not missing:
        return ""
    return (
        f"the gate's photographs ship in {' and '.join(missing)}, not installed: "
        f"pip install {' '.join(missing)}"
    )


def gate_pictures() -> list[Image.Image]:
    """The :data:`GATE_PICTURES` RGB pictures of the module docstring, in a fixed order."""
    import numpy as np
    import skimage.data
    from PIL import Image, ImageOps
    from sklearn.datasets import load_sample_images

    arrays = list(load_sample_images().images)
    arrays += [getattr(skimage.data, name)() for name in _SKIMAGE_PHOTOS]
    left, _, _ = skimage.data.stereo_motorcycle()  # type: ignore[no-untyped-call]
    arrays.append(left)
    out: list[Image.Image] = []
    for array in arrays:
        photo = Image.fromarray(np.asarray(array, dtype=np.uint8)).convert("RGB")
        width, height = photo.size
        out += [
            photo,
            photo.crop((0, 0, width // 2, height)),
            photo.crop((width // 2, 0, width, height)),
            ImageOps.mirror(photo),
        ]
    return out


def measure_pictures(spec: ModelSpec, knobs: Knobs, names: Sequence[str]) -> dict[str, Figures]:
    """Each of ``names`` (``fp32`` first) loaded in ``knobs``' layout: its speed and its
    outputs against fp32's on the gate's pictures (see the module docstring). A candidate
    that fails to load or run is kept with its error; fp32 failing raises."""
    import numpy as np

    from batchline.models.loader import load_model

    models: dict[str, Any] = {}
    errors: dict[str, str] = {}
    try:
        for name in names:
            try:
                models[name] = load_model(spec, knobs.replace(precision=name, quantize=None))
            except (BatchlineError, ImportError, OSError, RuntimeError) as exc:
                if name == "fp32":
                    raise
                errors[name] = f"did not load: {exc}"
        items = _prepared(models["fp32"], gate_pictures())
        speed: dict[str, list[float]] = {name: [] for name in models}
        rows: dict[str, npt.NDArray[np.float32]] = {}
        for sample in (items, items[::2]):
            for name, model in list(models.items()):
                try:
                    got, rate = _timed_rows(model, sample, knobs, warm=name not in rows)
                except Exception as exc:  # a backend's own error: the candidate is out
                    if name == "fp32":
                        raise
                    errors[name] = f"failed: {exc}"
                    models.pop(name).close()
                    continue
                speed[name].append(rate)
                rows.setdefault(name, got)
        classifies = models["fp32"].info.task == "classify"
    finally:
        for model in models.values():
            model.close()
    out = {"fp32": Figures(max(speed["fp32"]), top10_overlap=None)}
    for name in names[1:]:
        if name in errors:
            out[name] = Figures(error=errors[name])
            continue
        want, got = rows["fp32"], rows[name]
        norms = np.linalg.norm(want, axis=1) * np.linalg.norm(got, axis=1)
        cosine = float(np.mean(np.sum(want * got, axis=1) / np.maximum(norms, 1e-12)))
        top1 = float(np.mean(want.argmax(1) == got.argmax(1))) if classifies else None
        out[name] = Figures(max(speed[name]), cosine, None, top1_agreement=top1)
    return out


def _prepared(model: Any, pictures: Sequence[Image.Image]) -> list[Any]:
    items: list[Any] = model.prepare(list(pictures))
    bad = next((x for x in items if isinstance(x, BaseException)), None)
    if bad is not None:
        raise BatchlineError(f"a gate picture cannot be preprocessed: {bad}")
    return items


def _timed_rows(
    model: Any, items: Sequence[Any], knobs: Knobs, *, warm: bool
) -> tuple[npt.NDArray[np.float32], float]:
    """``items``' output rows (in order: :meth:`raw` of the image models) in batches of the
    job's size, ``max_concurrent_batches`` at a time, and the pictures/s of the model calls
    (after one untimed batch when ``warm``: oneDNN builds its kernels on the first)."""
    import numpy as np

    from batchline.models.image import PICTURE_TOKENS

    size = max(1, min(knobs.max_batch_size, knobs.target_batch_tokens // PICTURE_TOKENS))
    groups = [list(range(i, min(i + size, len(items)))) for i in range(0, len(items), size)]
    workers = max(1, min(knobs.max_concurrent_batches, knobs.sessions if knobs.batching else 1))
    if warm:
        model.raw([items[i] for i in groups[0]])
    out: npt.NDArray[np.float32] | None = None
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="precision") as pool:
        runs = pool.map(lambda g: (g, model.raw([items[i] for i in g])), groups)
        for group, result in runs:
            rows = np.asarray(result, dtype=np.float32)
            if out is None:
                out = np.zeros((len(items), rows.shape[1]), dtype=np.float32)
            out[group] = rows
    rate = len(items) / max(time.perf_counter() - start, 1e-9)
    assert out is not None
    return out, rate
