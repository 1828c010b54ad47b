"""The backends, in the order they are asked: the loader
(:func:`~batchline.models.loader.load_model`), the footprint estimate and the result cache's
identity each take the first that claims a spec. Adding a backend is one module (a
:class:`~batchline.models.backend.Backend`) and one line below; a test adds one for a
``with`` block with :meth:`~batchline.models.backend.Registry.registered`.

Order matters where two backends could take a spec: a generator is refused as a batch
function before anything else; a folder that reads pictures is the image backend's before it
is the Hugging Face folder's; the built-in encoder in bf16 is torch's before it is ONNX's.
"""

from __future__ import annotations

from batchline.models.backend import Registry
from batchline.models.function import PYTHON
from batchline.models.generation.backend import GENERATION
from batchline.models.hf.backend import HF_FOLDER, TORCH_BF16
from batchline.models.image.backend import IMAGE
from batchline.models.onnx.backend import ONNX

__all__ = ["BACKENDS"]

BACKENDS = Registry()
BACKENDS.register(GENERATION)
BACKENDS.register(PYTHON)
BACKENDS.register(IMAGE)
BACKENDS.register(HF_FOLDER)
BACKENDS.register(TORCH_BF16)
BACKENDS.register(ONNX)
