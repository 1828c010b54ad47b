"""An image folder's model on torch in bfloat16 (``precision = "bf16"``): the second runner
behind the image models of :mod:`.hf_image`, beside ONNX Runtime's session pool.

Where the CPU computes bf16 natively (AMX, AVX512-BF16), oneDNN's bf16 kernels run a vision
transformer about twice as fast as ONNX Runtime in fp32: ViT-S/16 with random weights, one
thread, batches of 8, the AMX Xeon (2026-12-02, a busy machine): 56 pictures/s in bf16 with
the linears packed, 13.5 in fp32 on torch; ONNX Runtime fp32 makes ~25 on both cores. The
logits kept a cosine of 0.9999 to fp32's.

:class:`TorchPixels` answers what the image models ask of a graph (``run`` with
``pixel_values``, its input and output names, its path for messages), so the classifier,
the embedder and the zero-shot classifier are the same classes on either runner. It calls
the same head the ONNX export traces (:mod:`.heads`), so both return the same outputs.

Example::

    pixels = load_torch_pixels(Path("vit/"), head="logits", knobs=Knobs(intra_op_threads=1))
    pixels.run({"pixel_values": batch})["logits"]          # float32, (len(batch), labels)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from batchline._errors import InputError, ModelError
from batchline.models.config import Knobs
from batchline.models.image.heads import ImageHead, load_head_model, output_name, wrap_head

__all__ = ["PixelsOutput", "TorchPixels", "load_torch_pixels"]


@dataclass(frozen=True, slots=True)
class PixelsOutput:
    """The runner's one output as the image models read a graph's: its name and shape
    (``width`` measured at load)."""

    name: str
    shape: tuple[int | str, ...]


class TorchPixels:
    """A head of an image folder's model on torch (in the dtype it was loaded in), run on a
    float32 ``pixel_values`` batch under ``torch.inference_mode()``; outputs as float32
    numpy. Safe to call from several threads (the batches that run at once)."""

    input_names = ("pixel_values",)
    #: batches that can run at once are the batcher's to bound: torch has no session pool
    sessions = 1

    def __init__(
        self,
        module: Any,
        *,
        path: Path,
        output: str,
        logit_scale: float | None = None,
        logit_bias: float | None = None,
    ) -> None:
        import torch

        self._torch = torch
        self.module = module
        self.path = path
        self.output_names = (output,)
        self.logit_scale, self.logit_bias = logit_scale, logit_bias
        self._dtype = next(module.parameters()).dtype
        # the width is the image models' to measure (one blank picture), as for a graph whose
        # output width is symbolic
        self.outputs = (PixelsOutput(output, ("batch", "width")),)

    @property
    def dtype(self) -> str:
        """``bfloat16`` or ``float32``: what the weights are held in."""
        return str(self._dtype).removeprefix("torch.")

    def run(
        self, feeds: Mapping[str, npt.ArrayLike], output_names: Sequence[str] | None = None
    ) -> dict[str, npt.NDArray[np.float32]]:
        """``{output: (batch, width) float32}`` for ``feeds["pixel_values"]``."""
        unknown = set(feeds) - set(self.input_names)
        if unknown or "pixel_values" not in feeds:
            raise InputError(f"{self.path.name} takes pixel_values alone, got {sorted(feeds)}")
        wanted = list(output_names or self.output_names)
        if wanted != list(self.output_names):
            raise InputError(f"{self.path.name} has the output {self.output_names[0]!r} only")
        pixels = np.ascontiguousarray(feeds["pixel_values"], dtype=np.float32)
        return {self.output_names[0]: self._call(pixels)}

    def _call(self, pixels: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        torch = self._torch
        with torch.inference_mode():
            out = self.module(torch.from_numpy(pixels).to(self._dtype))
            rows: npt.NDArray[np.float32] = out.float().numpy()
        return rows

    def __repr__(self) -> str:
        return f"TorchPixels({str(self.path)!r}, {self.output_names[0]}, {self.dtype})"


def load_torch_pixels(folder: Path, *, head: ImageHead, knobs: Knobs) -> TorchPixels:
    """``folder``'s model read through ``head``, in bfloat16 on the CPU with its linears
    packed once for oneDNN, torch on ``knobs.intra_op_threads`` threads.

    The weights load in float32 and are cast (the same rounding as loading in bfloat16), so
    that CLIP's and SigLIP's ``logit_scale`` and ``logit_bias`` are read before they are
    rounded: in bf16, 100 (``exp(4.6052)``) would become 98.9 or 102.

    Raises ``ModelError`` when torch or transformers is missing (with the install), when the
    folder does not load, or for a device other than the CPU.
    """
    if knobs.is_gpu:
        raise ModelError(
            f"{folder}: precision bf16 runs an image model on torch on the CPU; on "
            f"{knobs.device} use precision fp32 (ONNX Runtime)"
        )
    from batchline.models.hf import require_torch

    torch, transformers = require_torch(f"{folder} in precision bf16 (it runs on torch)")
    torch.set_num_threads(knobs.intra_op_threads)
    model = load_head_model(folder, head, transformers, torch)
    scalars = {name: _scalar(getattr(model, name, None)) for name in ("logit_scale", "logit_bias")}
    model.to(torch.bfloat16)
    from batchline.models.common.torch_weights import pack_linear_weights

    pack_linear_weights(model)
    return TorchPixels(
        wrap_head(torch, model, head),
        path=folder,
        output=output_name(head),
        logit_scale=scalars["logit_scale"],
        logit_bias=scalars["logit_bias"],
    )


def _scalar(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value.detach().reshape(-1)[0])
    except (AttributeError, IndexError, RuntimeError, TypeError) as exc:
        raise ModelError(f"cannot read a scalar weight of the model: {exc}") from exc
