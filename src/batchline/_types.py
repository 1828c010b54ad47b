"""Type aliases that several layers share, so each shape is named once.

Arrays are typed by their element type; code that accepts any array takes ``Array``.
"""

from typing import TypeAlias

import numpy as np
import numpy.typing as npt

Vector: TypeAlias = npt.NDArray[np.float32]
"""float32 values: one embedding, a batch of them, or a row of scores."""

Array: TypeAlias = npt.NDArray[np.generic]
"""An array of any element type (a model's named inputs and outputs)."""
