"""An ``nn.Linear`` whose weight is packed once for oneDNN (see
:func:`~batchline.models.common.torch_weights.pack_linear_weights`)."""

from __future__ import annotations

import torch

__all__ = ["PackedLinear"]

# The row count the packing is tuned for: a decode step of 16 sequences. Every count works.
_PACK_ROWS = 16


class PackedLinear(torch.nn.Module):
    """``linear``'s outputs (bf16: bit for bit) with the weight in oneDNN's blocked layout."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(
                linear.weight.detach(), _PACK_ROWS
            )
        self.bias = linear.bias

    @property
    def weight_bytes(self) -> int:
        """The weight's bytes (what a product reads)."""
        return self.in_features * self.out_features * int(self._packed.element_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self._packed, self.bias, "none", [], ""
        )
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"
