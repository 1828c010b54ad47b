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

import importlib.util
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from batchline.jobs.precision_gate import Figures
from batchline.jobs.precision_measure import Trial, measure, prepared
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


def _picture_batches(items: Sequence[Any], knobs: Knobs) -> list[list[int]]:
    """Batches in order, of the size the job's budget makes (``target_batch_tokens`` read as
    pictures of :data:`~batchline.models.image.PICTURE_TOKENS` tokens, at most
    ``max_batch_size``)."""
    from batchline.models.image import PICTURE_TOKENS

    size = max(1, min(knobs.max_batch_size, knobs.target_batch_tokens // PICTURE_TOKENS))
    return [list(range(i, min(i + size, len(items)))) for i in range(0, len(items), size)]


def _raw_rows(model: Any, batch: list[Any]) -> npt.NDArray[np.float32]:
    """A batch's output rows: :meth:`raw` of the image models (a classifier's logits, an
    embedder's vectors)."""
    import numpy as np

    return np.asarray(model.raw(batch), dtype=np.float32)


#: The pictures' trial but its comparison: preprocessed once (the same in every precision),
#: in batches of the job's size, through ``raw``, after one batch to warm up.
_PICTURES = Trial(
    prepare=partial(prepared, refused="picture cannot be preprocessed"),
    shared=True,
    batches=_picture_batches,
    run=_raw_rows,
    warm=True,
)


def measure_pictures(spec: ModelSpec, knobs: Knobs, names: Sequence[str]) -> dict[str, Figures]:
    """Each of ``names`` (``fp32`` first) loaded in ``knobs``' layout: its speed and its
    outputs against fp32's on the gate's pictures (see the module docstring), by
    :func:`~batchline.jobs.precision_measure.measure`. A candidate that fails to load or run
    is kept with its error; fp32 failing raises."""
    from batchline.models.loader import resolve_task

    classifies = resolve_task(spec) == "classify"

    def compare(rate: float, want: Any, got: Any) -> Figures:
        import numpy as np

        norms = np.linalg.norm(want, axis=1) * np.linalg.norm(got, axis=1)
        cosine = float(np.mean(np.sum(want * got, axis=1) / np.maximum(norms, 1e-12)))
        top1 = float(np.mean(want.argmax(1) == got.argmax(1))) if classifies else None
        return Figures(rate, cosine, None, top1_agreement=top1)

    return measure(spec, knobs, names, gate_pictures, trial=replace(_PICTURES, compare=compare))
