"""The Open Inference Protocol (KServe v2 / Triton HTTP), framework-free: numpy and the
standard library only, below every layer that speaks it (the server's ``/v2`` routes, the
benchmarks' client, the models' metadata).

- :mod:`batchline.oip.tensors`: the one datatype table (``DATATYPES``, :func:`dtype_of`,
  :func:`datatype_of`), the one :class:`TensorSpec`, and :class:`OipError`;
- :mod:`batchline.oip.codec`: request bytes to arrays (:func:`parse_infer_request`, one
  record per row with :func:`request_rows`) and arrays back to response bytes
  (:func:`stack_rows`, :func:`build_infer_response`), and the metadata documents.

Needs numpy (any extra that serves or runs tensor models brings it).
"""

from __future__ import annotations

from batchline.oip.codec import (
    HEADER_LENGTH_HEADER,
    InferRequest,
    RequestedOutputs,
    build_infer_response,
    classification_strings,
    model_metadata,
    parse_header_length,
    parse_infer_request,
    request_rows,
    server_metadata,
    stack_rows,
)
from batchline.oip.tensors import (
    DATATYPES,
    OipError,
    TensorSpec,
    TensorSpecLike,
    datatype_of,
    dtype_of,
    error_body,
)

__all__ = [
    "DATATYPES",
    "HEADER_LENGTH_HEADER",
    "InferRequest",
    "OipError",
    "RequestedOutputs",
    "TensorSpec",
    "TensorSpecLike",
    "build_infer_response",
    "classification_strings",
    "datatype_of",
    "dtype_of",
    "error_body",
    "model_metadata",
    "parse_header_length",
    "parse_infer_request",
    "request_rows",
    "server_metadata",
    "stack_rows",
]
