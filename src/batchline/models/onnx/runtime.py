"""ONNX Runtime backend: a pool of sessions, a batch-axis check at load, and collate helpers.

One session per processing slot: on a 2-core CPU two sessions with one intra-op thread each
beat one session with two threads, and two callers sharing a two-thread session oversubscribe
the cores. So :class:`OnnxModel` holds ``sessions`` sessions in a queue and :meth:`OnnxModel.run`
borrows a free one, which makes it safe to call from several threads at once.

Example::

    model = OnnxModel.load("model.onnx", sessions=2, intra_op_threads=1)
    ids, mask = pad_sequences([[101, 7592, 102], [101, 102]], pad_value=0)
    out = model.run({"input_ids": ids, "attention_mask": mask})
"""

from __future__ import annotations

import os
import queue
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from batchline._errors import FixedBatchAxisError, InputError, ModelError
from batchline._types import Array
from batchline.oip.tensors import DATATYPES, TensorSpec, dtype_of

__all__ = [
    "ONNX_DATATYPES",
    "OnnxModel",
    "OnnxTensor",
    "pad_sequences",
    "split_rows",
    "stack_equal",
]

ProviderSpec = str | tuple[str, Mapping[str, object]]

# Short names users may pass instead of ONNX Runtime's full provider names.
_PROVIDER_ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "directml": "DmlExecutionProvider",
}

#: ONNX Runtime element types -> Open Inference Protocol datatypes, whose numpy dtypes
#: (:data:`batchline.oip.DATATYPES`) are what the sessions are fed. BF16 has no numpy dtype:
#: such a tensor is described (metadata) but cannot be fed.
ONNX_DATATYPES: dict[str, str] = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(bfloat16)": "BF16",
    "tensor(string)": "BYTES",
}

# Batch sizes tried by the load-time probe. Three of them: a graph baked at batch 1 (the usual
# export dummy) passes 1 and fails 2 and 3; one baked at 2 passes only 2.
_PROBE_BATCH_SIZES = (1, 2, 3)
# Length given to symbolic non-batch dimensions (sequence length, ...) during the probe.
_PROBE_DIM = 4

_INDEX0_RE = re.compile(r"index:\s*0\b")


@dataclass(frozen=True, slots=True)
class OnnxTensor:
    """Name, shape and element type of one graph input or output, as ONNX Runtime reports them.

    ``shape`` holds an ``int`` for a fixed dimension and a ``str`` (or ``None``) for a
    symbolic one. :meth:`spec` is the same tensor as the Open Inference Protocol describes it.
    """

    name: str
    shape: tuple[int | str | None, ...]
    type: str

    @property
    def datatype(self) -> str:
        """The Open Inference Protocol datatype (``FP32``, ``INT64``...; the ONNX type if none)."""
        return ONNX_DATATYPES.get(self.type, self.type)

    @property
    def dtype(self) -> np.dtype[np.generic]:
        """The numpy dtype for this tensor (``object`` for strings)."""
        try:
            return dtype_of(self.datatype)
        except ValueError:
            feedable = (t for t, d in ONNX_DATATYPES.items() if d in DATATYPES)
            raise ModelError(
                f"tensor '{self.name}' has element type {self.type}, which batchline cannot "
                "feed; supported: " + ", ".join(sorted(feedable))
            ) from None

    def spec(self) -> TensorSpec:
        """``{"name", "datatype", "shape"}`` for metadata: ``-1`` for each dynamic dimension."""
        shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in self.shape)
        return TensorSpec(self.name, self.datatype, shape)


class OnnxModel:
    """An ONNX model behind a pool of ONNX Runtime sessions.

    Build it with :meth:`load`. :meth:`run` is thread-safe: each call borrows one free session,
    so at most ``sessions`` calls run at once and the rest wait for a session.
    """

    def __init__(
        self,
        path: Path,
        sessions: Sequence[ort.InferenceSession],
        *,
        providers: Sequence[str],
        shared: bool = False,
    ) -> None:
        if not sessions:
            raise ValueError("an OnnxModel needs at least one session")
        if shared and len(sessions) != 1:
            raise ValueError("a shared OnnxModel has exactly one session")
        #: One session that every caller uses at once (ONNX Runtime's run() is thread-safe):
        #: the no-batching baseline. Otherwise each call borrows a session of its own.
        self.shared = shared
        self.path = path
        self.providers: tuple[str, ...] = tuple(providers)
        first = sessions[0]
        self.inputs: tuple[OnnxTensor, ...] = tuple(
            OnnxTensor(i.name, tuple(i.shape), i.type) for i in first.get_inputs()
        )
        self.outputs: tuple[OnnxTensor, ...] = tuple(
            OnnxTensor(o.name, tuple(o.shape), o.type) for o in first.get_outputs()
        )
        self._all_sessions = tuple(sessions)
        self._pool: queue.Queue[ort.InferenceSession] = queue.Queue()
        self._overflow = 0
        for s in sessions:
            self._pool.put(s)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        sessions: int = 2,
        intra_op_threads: int = 1,
        providers: Sequence[ProviderSpec] | None = None,
        spinning: bool = False,
        check_batch_axis: bool = True,
        shared: bool = False,
    ) -> OnnxModel:
        """Load an ``.onnx`` file into ``sessions`` ONNX Runtime sessions.

        Args:
            path: the ``.onnx`` file.
            sessions: how many sessions to open; one per batch you want in flight at once.
            intra_op_threads: threads each session may use inside one operator. On a CPU,
                ``sessions * intra_op_threads`` should not exceed the number of cores.
            providers: execution providers in order of preference, full ONNX Runtime names
                (``"CUDAExecutionProvider"``), short ones (``"cuda"``, ``"tensorrt"``, ``"cpu"``)
                or ``(name, options)`` pairs. Default: CPU only. The CPU provider is appended
                as a fallback for operators a GPU provider cannot run.
            spinning: let idle intra-op threads spin. Spinning shaves a little latency off
                back-to-back calls but burns about half a core between them.
            shared: open one session and let every caller run on it at once, without waiting
                for a free one: the single-shared-session baseline (``sessions`` must be 1).
            check_batch_axis: refuse models whose batch dimension is fixed, and probe the
                model with dummy batches of 1, 2 and 3 rows to catch batch sizes baked
                inside the graph.

        Raises:
            ModelError: the file is missing or invalid, or a provider is not available.
            FixedBatchAxisError: the model cannot take batches of any size.

        Example::

            model = OnnxModel.load("encoder.onnx", sessions=2, intra_op_threads=1)
        """
        if sessions < 1:
            raise ValueError(f"sessions must be >= 1, got {sessions}")
        if intra_op_threads < 1:
            raise ValueError(f"intra_op_threads must be >= 1, got {intra_op_threads}")
        model_path = Path(path)
        if not model_path.is_file():
            raise ModelError(f"ONNX model file not found: {model_path}")

        resolved = _resolve_providers(providers)
        opts = _session_options(intra_op_threads=intra_op_threads, spinning=spinning)
        disabled = _disabled_optimizers(resolved)
        opened: list[ort.InferenceSession] = []
        for _ in range(sessions):
            try:
                sess = ort.InferenceSession(
                    str(model_path),
                    sess_options=opts,
                    providers=resolved,
                    disabled_optimizers=disabled,
                )
            except Exception as exc:  # ORT raises its own pybind classes, not ValueError
                raise ModelError(f"ONNX Runtime could not load {model_path}: {exc}") from exc
            _check_providers_active(sess, resolved)
            opened.append(sess)
        active = opened[0].get_providers()
        model = cls(model_path, opened, providers=active, shared=shared)
        if check_batch_axis:
            model.check_batch_axis()
        return model

    @property
    def sessions(self) -> int:
        """The number of sessions in the pool: how many :meth:`run` calls can run at once."""
        return len(self._all_sessions)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outputs)

    @contextmanager
    def session(self) -> Iterator[ort.InferenceSession]:
        """Borrow one session from the pool for the duration of a ``with`` block."""
        if self.shared:
            yield self._all_sessions[0]
            return
        try:
            sess = self._pool.get_nowait()
        except queue.Empty:
            # more batches at once than sessions (``max_concurrent_batches`` above
            # ``sessions``): run beside another on one (ONNX Runtime's run() is thread-safe)
            self._overflow = (self._overflow + 1) % len(self._all_sessions)
            yield self._all_sessions[self._overflow]
            return
        try:
            yield sess
        finally:
            self._pool.put(sess)

    def run(
        self,
        feeds: Mapping[str, npt.ArrayLike],
        output_names: Sequence[str] | None = None,
    ) -> dict[str, Array]:
        """Run one batch on a free session and return ``{output name: array}``.

        Blocks while every session is busy. Safe to call from several threads.

        Raises:
            InputError: a feed is missing, unknown, or of the wrong rank.
            ModelError: ONNX Runtime failed for another reason.
        """
        names = list(output_names) if output_names is not None else list(self.output_names)
        arrays = self._check_feeds(feeds)
        with self.session() as sess:
            try:
                results = sess.run(names, arrays)
            except Exception as exc:
                raise ModelError(f"ONNX Runtime failed on {self.path.name}: {exc}") from exc
        return dict(zip(names, results, strict=True))

    def _check_feeds(self, feeds: Mapping[str, npt.ArrayLike]) -> dict[str, Array]:
        expected = {i.name: i for i in self.inputs}
        missing = [n for n in expected if n not in feeds]
        unknown = [n for n in feeds if n not in expected]
        if missing or unknown:
            parts = [f"missing {missing}"] if missing else []
            parts += [f"unknown {unknown}"] if unknown else []
            raise InputError(
                f"feeds do not match the inputs of {self.path.name}: {'; '.join(parts)}; "
                f"the model takes {list(expected)}"
            )
        out: dict[str, Array] = {}
        for name, value in feeds.items():
            spec = expected[name]
            arr = np.asarray(value)
            if arr.ndim != len(spec.shape):
                raise InputError(
                    f"input '{name}' of {self.path.name} has rank {len(spec.shape)} "
                    f"(shape {list(spec.shape)}), got an array of shape {arr.shape}"
                )
            if arr.dtype != spec.dtype:
                arr = arr.astype(spec.dtype)
            out[name] = arr
        return out

    def check_batch_axis(self) -> None:
        """Raise :class:`FixedBatchAxisError` unless the model takes any batch size.

        Two checks: no input may declare a fixed first dimension, and dummy batches of 1, 2
        and 3 rows must each run and give outputs with as many rows as the inputs (a batch
        size baked into a Reshape can make ONNX Runtime return the wrong number of rows
        without an error).
        """
        for spec in self.inputs:
            if not spec.shape:
                raise FixedBatchAxisError(
                    f"model input '{spec.name}' of {self.path.name} is a scalar, so it has no "
                    "batch dimension; batchline needs the first dimension of every input to be "
                    "the batch. Re-export with a leading batch axis and "
                    f"dynamic_axes={{'{spec.name}': {{0: 'batch'}}}} in torch.onnx.export"
                )
            first = spec.shape[0]
            if isinstance(first, int) and first > 0:
                raise FixedBatchAxisError(_fixed_input_message(spec.name, first, self.path.name))
        self._probe_batch_sizes()

    def _probe_batch_sizes(self) -> None:
        ok: dict[int, dict[str, tuple[int, ...]]] = {}
        failed: dict[int, str] = {}
        for n in _PROBE_BATCH_SIZES:
            feeds = {spec.name: _dummy_input(spec, n) for spec in self.inputs}
            with self.session() as sess:
                try:
                    results = sess.run(None, feeds)
                except Exception as exc:
                    msg = str(exc).strip()
                    fixed = _fixed_input_from_ort_message(msg, self.input_names)
                    if fixed is not None:
                        raise FixedBatchAxisError(
                            _fixed_input_message(fixed, None, self.path.name)
                            + f" (ONNX Runtime: {msg})"
                        ) from exc
                    failed[n] = msg
                    continue
            ok[n] = {o.name: tuple(np.shape(r)) for o, r in zip(self.outputs, results, strict=True)}

        if not ok:
            first = failed[_PROBE_BATCH_SIZES[0]]
            raise ModelError(
                f"could not check the batch axis of {self.path.name}: it failed on dummy inputs "
                f"(ids 1, float zeros, length {_PROBE_DIM}): {first}. If the model needs real "
                "values, load it with check_batch_axis=False"
            )
        if failed:
            good = sorted(ok)
            bad, msg = next(iter(failed.items()))
            raise FixedBatchAxisError(
                f"model {self.path.name} runs with a batch of {good[0]} but fails with a batch "
                f"of {bad}, so a batch size is fixed inside the graph (ONNX Runtime: {msg}). "
                "Re-export with dynamic_axes={'<input>': {0: 'batch'}, '<output>': {0: 'batch'}} "
                "in torch.onnx.export, and write reshapes with -1 or x.shape[0] instead of a "
                "constant batch size"
            )
        for n, shapes in ok.items():
            for name, shape in shapes.items():
                rows = shape[0] if shape else None
                if rows != n:
                    got = "a scalar" if rows is None else f"{rows} rows"
                    raise FixedBatchAxisError(
                        f"model output '{name}' of {self.path.name} has {got} for a batch of "
                        f"{n} rows, so a batch size is baked inside the graph (often a Reshape "
                        "to a constant shape); results would be silently wrong. Re-export with "
                        f"dynamic_axes={{'<input>': {{0: 'batch'}}, '{name}': {{0: 'batch'}}}} "
                        "in torch.onnx.export, and write reshapes with -1 or x.shape[0]"
                    )

    def __repr__(self) -> str:
        return (
            f"OnnxModel({str(self.path)!r}, sessions={self.sessions}, "
            f"providers={list(self.providers)})"
        )


def _fixed_input_message(name: str, size: int | None, model: str) -> str:
    dim = f" {size}" if size is not None else ""
    return (
        f"model input '{name}' of {model} has a fixed batch dimension{dim}, so it cannot be "
        f"batched; re-export with dynamic_axes={{'{name}': {{0: 'batch'}}}} in "
        "torch.onnx.export (and the same for every other input and output)"
    )


def _fixed_input_from_ort_message(msg: str, input_names: Sequence[str]) -> str | None:
    # ORT: "Got invalid dimensions for input: input_ids for the following indices
    #  index: 0 Got: 3 Expected: 2"
    if "invalid dimensions for input" not in msg or not _INDEX0_RE.search(msg):
        return None
    match = re.search(r"for input:\s*(\S+)", msg)
    if match and match.group(1) in input_names:
        return match.group(1)
    return input_names[0] if input_names else "?"


def _dummy_input(spec: OnnxTensor, batch: int) -> Array:
    dims = [batch] + [d if isinstance(d, int) and d > 0 else _PROBE_DIM for d in spec.shape[1:]]
    dtype = spec.dtype
    if dtype.kind in "iub":
        # Small ids are valid token ids for any vocabulary, and 1 is a valid attention mask.
        return np.ones(dims, dtype=dtype)
    if dtype.kind == "O":
        return np.full(dims, "a", dtype=object)
    return np.zeros(dims, dtype=dtype)


def _provider_name(provider: ProviderSpec) -> str:
    return provider if isinstance(provider, str) else provider[0]


def _resolve_providers(providers: Sequence[ProviderSpec] | None) -> list[ProviderSpec]:
    if providers is None:
        return ["CPUExecutionProvider"]
    if isinstance(providers, str):
        providers = [providers]
    available = ort.get_available_providers()
    resolved: list[ProviderSpec] = []
    for p in providers:
        name, options = (p, None) if isinstance(p, str) else (p[0], p[1])
        name = _PROVIDER_ALIASES.get(name.lower(), name)
        if name not in available:
            hint = ""
            if name in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
                hint = (
                    "; install the GPU build (pip install onnxruntime-gpu, in place of "
                    "onnxruntime) with a matching CUDA/cuDNN"
                )
            raise ModelError(
                f"ONNX Runtime provider {name} is not available in this installation "
                f"(available: {', '.join(available)}){hint}, or pass providers=['cpu']"
            )
        resolved.append(name if options is None else (name, options))
    if "CPUExecutionProvider" not in map(_provider_name, resolved):
        resolved.append("CPUExecutionProvider")
    return resolved


def _check_providers_active(sess: ort.InferenceSession, wanted: Sequence[ProviderSpec]) -> None:
    # ORT falls back to CPU with only a log line when, e.g., the CUDA libraries fail to load.
    active = set(sess.get_providers())
    for name in map(_provider_name, wanted):
        if name not in active:
            raise ModelError(
                f"ONNX Runtime could not start provider {name} (active: {sorted(active)}); "
                "check the GPU driver and CUDA/cuDNN libraries, or pass providers=['cpu']"
            )


#: Graph rewrites that make a CPU session slower. ``SkipLayerNormFusion`` folds a residual
#: ``Add`` and its ``LayerNormalization`` into ``SkipLayerNormalization``, whose CPU kernel took
#: 1.92 ms against 0.30 ms for the three ops it replaces on a (32, 40, 384) float32 batch, one
#: thread (onnxruntime 1.32, 2026-11-28). It fires on the int8 MiniLM graph, where it cost a
#: quarter of the run time; GPU providers keep it.
_CPU_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)


def _disabled_optimizers(providers: Sequence[ProviderSpec]) -> list[str]:
    """The graph rewrites to leave out for a session on ``providers``: the CPU-slower ones
    when the CPU runs every operator."""
    cpu_only = {*map(_provider_name, providers)} == {"CPUExecutionProvider"}
    return list(_CPU_DISABLED_OPTIMIZERS) if cpu_only else []


def _session_options(*, intra_op_threads: int, spinning: bool) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = intra_op_threads
    # Parallelism comes from the session pool, not from running operators side by side.
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    spin = "1" if spinning else "0"
    opts.add_session_config_entry("session.intra_op.allow_spinning", spin)
    opts.add_session_config_entry("session.inter_op.allow_spinning", spin)
    # Warnings about unused initializers and the like are noise for users; errors still raise.
    opts.log_severity_level = 3
    return opts


# --- collate helpers ------------------------------------------------------------------------


def stack_equal(arrays: Sequence[npt.ArrayLike]) -> Array:
    """Stack per-record arrays of one shape into a batch (a new leading axis).

    Raises:
        InputError: the arrays differ in shape (pad them with :func:`pad_sequences` instead).
    """
    if not arrays:
        raise InputError("cannot stack an empty list of arrays")
    arrs = [np.asarray(a) for a in arrays]
    shape = arrs[0].shape
    for i, a in enumerate(arrs):
        if a.shape != shape:
            raise InputError(
                f"record {i} has shape {a.shape} but record 0 has {shape}; records of "
                "different lengths need pad_sequences()"
            )
    return np.stack(arrs)


def pad_sequences(
    sequences: Sequence[npt.ArrayLike],
    *,
    pad_value: int = 0,
    dtype: npt.DTypeLike = np.int64,
    length: int | None = None,
) -> tuple[Array, Array]:
    """Right-pad 1-D integer sequences to one length; return ``(padded, attention_mask)``.

    Both arrays have shape ``(len(sequences), length)``, where ``length`` defaults to the
    longest sequence. The mask is 1 on real tokens and 0 on padding.

    Example::

        ids, mask = pad_sequences([[101, 7, 102], [101, 102]])
        # ids  == [[101, 7, 102], [101, 102, 0]]
        # mask == [[1, 1, 1], [1, 1, 0]]
    """
    seqs = [np.asarray(s) for s in sequences]
    for i, s in enumerate(seqs):
        if s.ndim != 1:
            raise InputError(f"sequence {i} must be 1-D, got shape {s.shape}")
    longest = max((len(s) for s in seqs), default=0)
    width = longest if length is None else length
    if width < longest:
        raise InputError(f"length={length} is shorter than the longest sequence ({longest})")
    padded = np.full((len(seqs), width), pad_value, dtype=dtype)
    mask = np.zeros((len(seqs), width), dtype=dtype)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return padded, mask


def split_rows(batch: Array, lengths: Sequence[int] | None = None) -> list[Array]:
    """Split a batch output back into one array per record.

    With ``lengths``, axis 1 is a padded sequence axis and each record keeps only its first
    ``lengths[i]`` positions (for per-token outputs such as ``(batch, seq, hidden)``).
    """
    if lengths is None:
        return list(batch)
    if len(lengths) != len(batch):
        raise InputError(f"got {len(lengths)} lengths for a batch of {len(batch)} rows")
    if batch.ndim < 2:
        raise InputError(f"cannot strip padding from an output of shape {batch.shape}")
    return [batch[i, :n] for i, n in enumerate(lengths)]
