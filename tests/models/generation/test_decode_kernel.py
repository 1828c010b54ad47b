"""batchline's compiled decode attention: each row attends over its own columns of the slot
store and nothing else, as softmax attention computes it; without a compiler (or with the
kernel turned off) the engine attends through SDPA and says why."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from batchline.models.generation import decode_kernel as dk  # noqa: E402
from batchline.models.generation import torch_engine  # noqa: E402
from batchline.models.generation.torch_engine import TorchStepEngine  # noqa: E402


@pytest.fixture(scope="module")
def kernel() -> Any:
    op, why = dk.decode_kernel()
    if op is None:
        pytest.skip(f"the decode kernel cannot be built here: {why}")
    return op


def _reference(
    q: Any, keys: Any, values: Any, first: list[int], hi: int, scale: float, softcap: float = 0.0
) -> Any:
    """Softmax attention of each row over columns [first, hi] of its slot, in float64, its
    scores soft-capped where ``softcap`` says."""
    rows, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(rows):
        for head in range(heads):
            k = keys[b, head // group, first[b] : hi + 1].double()
            v = values[b, head // group, first[b] : hi + 1].double()
            scores = k @ q[b, head].double() * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            weights = torch.softmax(scores, dim=0)
            out[b, head] = weights @ v
    return out


# (dtype, head_dim, heads, kv_heads): dims 64 and 128 in bfloat16 take the AVX512-BF16 path
# where the CPU has it, float32 ones the AVX-512 path (query heads summed four at a time: groups
# of 3, 4, 5 and 8 cover each split), or AVX2's where the CPU has no AVX-512 (a head at a time;
# a group of 1 as in SmolLM2-1.7B); a group over 8 and dims 16 and 24 the portable loops.
CASES = [
    ("bfloat16", 64, 9, 3),
    ("bfloat16", 128, 8, 2),
    ("bfloat16", 64, 8, 1),
    ("bfloat16", 128, 10, 2),
    ("bfloat16", 64, 12, 1),
    ("bfloat16", 16, 4, 4),
    ("float32", 64, 9, 3),
    ("float32", 128, 8, 1),
    ("float32", 64, 4, 4),
    ("float32", 24, 6, 2),
]


@pytest.mark.parametrize("softcap", [0.0, 0.5], ids=["uncapped", "capped"])
@pytest.mark.parametrize(("dtype", "dim", "heads", "kv_heads"), CASES)
def test_each_row_attends_over_its_own_columns(
    kernel: Any, dtype: str, dim: int, heads: int, kv_heads: int, softcap: float
) -> None:
    gen = torch.Generator().manual_seed(dim * heads)
    slots, capacity, hi, rows = 6, 40, 33, 5
    kind = getattr(torch, dtype)
    keys = torch.randn(slots, kv_heads, capacity, dim, generator=gen).to(kind)
    values = torch.randn(slots, kv_heads, capacity, dim, generator=gen).to(kind)
    q = torch.randn(rows, heads, dim, generator=gen).to(kind)
    # one column only, a few, most, all of them (34: two blocks of 16 keys and a tail of 2)
    first = [hi, 30, 12, 0, 21]
    # What lies outside a row's columns (padding, a longer row's past) must not count.
    for b, f in enumerate(first):
        keys[b, :, :f] = float("nan")
        values[b, :, :f] = float("nan")
        keys[b, :, hi + 1 :] = float("inf")
    scale = dim**-0.5
    got = kernel(q, keys, values, torch.tensor(first), hi, scale, softcap)
    assert got.dtype == kind
    assert got.shape == q.shape
    expected = _reference(q, keys, values, first, hi, scale, softcap)
    if softcap:  # a cap of 0.5 bends scores of ~1: the uncapped answer is not this one
        uncapped = _reference(q, keys, values, first, hi, scale)
        assert (uncapped - expected)[1:].abs().max() > 0.05
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)
    # A row of one column gives that column's value back.
    torch.testing.assert_close(
        got[0].double(), values[0, :, hi].double().repeat_interleave(heads // kv_heads, 0)
    )


def test_bad_arguments_are_refused_with_what_is_wrong(kernel: Any) -> None:
    keys = torch.zeros(2, 1, 8, 16)
    q = torch.zeros(2, 2, 16)
    with pytest.raises(RuntimeError, match=r"first\[b\] must be in \[0, hi\]"):
        kernel(q, keys, keys, torch.tensor([0, 6]), 5, 0.25)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        kernel(q, keys, keys, torch.tensor([0, 0]), 5, 0.25, -1.0)
    with pytest.raises(RuntimeError, match="hi outside the buffers"):
        kernel(q, keys, keys, torch.tensor([0, 0]), 8, 0.25)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(q.bfloat16(), keys, keys, torch.tensor([0, 0]), 5, 0.25)
    with pytest.raises(RuntimeError, match="more rows than slots"):
        kernel(torch.zeros(3, 2, 16), keys, keys, torch.tensor([0, 0, 0]), 5, 0.25)


@pytest.fixture(scope="module")
def ops(kernel: Any) -> Any:
    return dk.StepOps()  # the kernel fixture loaded the library


def _rotate_like_torch(x: Any, cos: Any, sin: Any) -> Any:
    """lean_llama's torch chain: x * cos + rotate_half(x) * sin over the first r values."""
    r = cos.shape[-1]
    head, rest = x[..., :r], x[..., r:]
    turned = torch.cat((head[..., r // 2 :], head[..., : r // 2]), dim=-1)
    return torch.cat(((head * cos) + (turned * sin), rest), dim=-1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rotary", [16, 8])  # the whole head, or half of it (Phi-3)
def test_the_rotary_op_gives_torchs_values_bit_for_bit(ops: Any, dtype: str, rotary: int) -> None:
    gen = torch.Generator().manual_seed(rotary)
    kind = getattr(torch, dtype)
    # q as a slice of the fused q/k/v product: 2 heads of 16, rows 40 values apart
    x = torch.randn(5, 40, generator=gen).to(kind)[:, :32].view(5, 2, 16)
    cos = torch.randn(5, 1, rotary, generator=gen).to(kind)
    sin = torch.randn(5, 1, rotary, generator=gen).to(kind)
    assert torch.equal(ops.rotary(x, cos, sin), _rotate_like_torch(x, cos, sin))
    per_head = cos.expand(5, 2, rotary).contiguous()  # one cos per head: not what it takes
    with pytest.raises(RuntimeError, match=r"rotary: cos and sin \(tokens, 1, r\)"):
        ops.rotary(x, per_head, per_head)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_norm_and_activation_ops_give_torchs_values(ops: Any, dtype: str) -> None:
    gen = torch.Generator().manual_seed(7)
    kind = getattr(torch, dtype)
    x, weight = torch.randn(6, 40, generator=gen).to(kind), torch.randn(40, generator=gen).to(kind)
    h = x.float()
    norm = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(kind)
    # 43 values a row: five vectors of 8 and a scalar tail (exp_approx8 where AVX2 is)
    gate_up = (torch.randn(6, 2 * 43, generator=gen) * 4).to(kind)
    silu = torch.nn.functional.silu(gate_up[:, :43]) * gate_up[:, 43:]
    gelu = torch.nn.functional.gelu(gate_up[:, :43], approximate="tanh") * gate_up[:, 43:]
    # the sum of squares in another order, silu's own exp: float32's last bits, one bf16 step
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == "float32" else {"atol": 0, "rtol": 1e-2}
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), norm, **tolerance)
    torch.testing.assert_close(ops.silu_mul(gate_up), silu, **tolerance)
    # where tanh saturates, torch's 0.5 x (1 + tanh) is 0 and x / (1 + exp) a few 1e-7
    torch.testing.assert_close(
        ops.gelu_tanh_mul(gate_up), gelu, **{**tolerance, "atol": max(tolerance["atol"], 1e-6)}
    )
    with pytest.raises(RuntimeError, match=r"gelu_tanh_mul: gate_up \(rows, 2 \* n\)"):
        ops.gelu_tanh_mul(gate_up[:, :-1])
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        ops.silu_mul(gate_up.double())
    with pytest.raises(RuntimeError, match="rms_norm: x"):
        ops.rms_norm(x, weight[:-1], 1e-6)
    # a float32 weight beside x: Gemma's order, weighed in float32 and then rounded once
    offset = 1.0 + weight.float()
    gemma = ((h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)) * offset).to(kind)
    torch.testing.assert_close(ops.rms_norm(x, offset, 1e-6), gemma, **tolerance)
    with pytest.raises(RuntimeError, match="rms_norm: x"):
        ops.rms_norm(x.float(), weight.double(), 1e-6)


def test_the_engine_takes_the_kernel_on_the_cpu_by_default(kernel: Any, tiny_llama: Any) -> None:
    assert TorchStepEngine(tiny_llama).decode_attention == "kernel"
    assert TorchStepEngine(tiny_llama, decode_attention="sdpa").decode_attention == "sdpa"


def test_a_model_in_float16_attends_through_sdpa(kernel: Any) -> None:
    from .conftest import build_tiny_llama

    model = build_tiny_llama().half()
    assert TorchStepEngine(model).decode_attention == "sdpa"
    with pytest.raises(ValueError, match=r"computes in torch\.float16, the kernel in float32"):
        TorchStepEngine(model, decode_attention="kernel")


def test_without_the_kernel_auto_attends_through_sdpa_and_kernel_refuses(
    tiny_llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch_engine, "decode_kernel", lambda: (None, "no C++ compiler"))
    assert TorchStepEngine(tiny_llama).decode_attention == "sdpa"
    with pytest.raises(ValueError, match="decode_attention='kernel' cannot be had: no C"):
        TorchStepEngine(tiny_llama, decode_attention="kernel")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_two_threads_give_the_bits_one_thread_gives(kernel: Any, dtype: str) -> None:
    # Rows and KV heads are split over torch's threads (in pieces of ~512 key columns at least:
    # here 600 columns, so each row and head is a piece), each computed as it is on one thread.
    gen = torch.Generator().manual_seed(4)
    kind = getattr(torch, dtype)
    keys = torch.randn(5, 3, 640, 64, generator=gen).to(kind)
    values = torch.randn(5, 3, 640, 64, generator=gen).to(kind)
    q = torch.randn(5, 9, 64, generator=gen).to(kind)
    first = torch.tensor([0, 7, 300, 599, 42])
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(kernel(q, keys, values, first, 599, 0.125, 0.0))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    reference = _reference(q, keys, values, first.tolist(), 599, 0.125)
    assert float((outs[1].double() - reference).abs().max()) < 0.05


def test_no_compiler_or_turned_off_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert dk._load() == (None, "no C++ compiler (no-such-compiler-here not found)")
    monkeypatch.setenv("BATCHLINE_DECODE_KERNEL", "0")
    assert dk._load() == (None, "BATCHLINE_DECODE_KERNEL=0")


def test_a_kernel_folder_that_cannot_be_made_says_which_setting_moves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    source = tmp_path / "one.cpp"
    source.write_text("int batchline_test_one() { return 1; }\n")
    monkeypatch.setattr(dk, "_SOURCES", (source,))
    monkeypatch.setenv("BATCHLINE_KERNEL_DIR", str(blocked / "kernels"))
    op, why = dk._load()
    assert op is None
    assert why.startswith(f"OSError: cannot build the kernel in {blocked / 'kernels'} (")
    assert why.endswith("; set BATCHLINE_KERNEL_DIR to a writable folder")


def test_a_build_error_is_reported_and_nothing_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good, bad = tmp_path / "good.cpp", tmp_path / "bad.cpp"
    good.write_text("int batchline_test_one() { return 1; }\n")
    bad.write_text("this is not C++\n")
    # compiled side by side: the second source's failure is the one reported
    monkeypatch.setattr(dk, "_SOURCES", (good, bad))
    monkeypatch.setenv("BATCHLINE_KERNEL_DIR", str(tmp_path / "kernels"))
    op, why = dk._load()
    assert op is None
    assert why.startswith("RuntimeError: ")
    assert "exited 1" in why
    # no half-built library: only the lock that its build held
    left = [p.name for p in (tmp_path / "kernels").iterdir()]
    assert len(left) == 1, left
    assert left[0].endswith(".so.lock"), left


def test_two_processes_asking_at_once_build_the_library_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    source = tmp_path / "one.cpp"
    source.write_text("int batchline_test_one() { return 1; }\n")
    monkeypatch.setattr(dk, "_SOURCES", (source,))
    monkeypatch.setenv("BATCHLINE_KERNEL_DIR", str(tmp_path / "kernels"))
    links: list[list[str]] = []
    linking, waiting = threading.Event(), threading.Event()

    class Waiting(logging.Handler):  # the second asker's word that it waits
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for" in record.getMessage():
                waiting.set()

    def compile_held(command: list[str]) -> None:  # writes what the compiler would
        if "-shared" in command:
            links.append(command)
            linking.set()
            assert waiting.wait(30)  # the link ends only once the other asker waits for it
        Path(command[command.index("-o") + 1]).write_bytes(b"built")

    monkeypatch.setattr(dk, "_compile", compile_held)
    # two opens of one lock file exclude each other as two processes' do (flock)
    caplog.set_level(logging.INFO, logger=dk.__name__)
    handler = Waiting()
    dk.logger.addHandler(handler)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(dk._built, compiler)
            assert linking.wait(30)
            second = pool.submit(dk._built, compiler)
            paths = {first.result(timeout=60), second.result(timeout=60)}
    finally:
        dk.logger.removeHandler(handler)
    assert len(paths) == 1
    assert next(iter(paths)).read_bytes() == b"built"
    assert len(links) == 1
    assert f"waiting for pid {os.getpid()} to build" in caplog.text


def test_a_built_kernel_is_reused(
    kernel: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    compiles: list[list[str]] = []
    real_run = subprocess.run

    def counting(command: list[str], **kwargs: Any) -> Any:
        if "-shared" in command:
            compiles.append(command)
        return real_run(command, **kwargs)

    monkeypatch.setattr(dk.subprocess, "run", counting)
    # The kernel this process loaded, wherever its folder was when it was first asked for; a
    # fresh cache folder (a job's own) does not build it again where the kernel folder has it.
    loaded = Path(dk.decode_kernel()[1])
    monkeypatch.setenv("BATCHLINE_KERNEL_DIR", str(loaded.parent))
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "fresh-cache"))
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    assert compiler is not None  # the kernel fixture built it
    assert dk._built(compiler) == loaded
    assert compiles == []
    assert not (tmp_path / "fresh-cache").exists()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_decode_only_steps_attention_in_one_call_gives_the_same_bits(
    kernel: Any, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``decode_step`` (q/k/v sliced, rotated, written to the store and attended in one call)
    against the same calls made one by one from Python: every pass's logits, bit for bit, over
    prefills, decode-only steps and a step that mixes a decoding row with a joining prompt."""
    from batchline.models.generation.lean_llama import LeanForward, fuse_projections

    from .conftest import build_tiny_llama, run_mixed_steps

    passes: list[Any] = []
    real_call = LeanForward.__call__

    def recording(self: Any, *args: Any) -> Any:
        out = real_call(self, *args)
        passes.append(out.clone())
        return out

    monkeypatch.setattr(LeanForward, "__call__", recording)

    def run(fuse: bool) -> tuple[list[Any], int]:
        passes.clear()
        model = build_tiny_llama().to(getattr(torch, dtype))
        fuse_projections(model)  # as the loader does: q/k/v in one linear
        if not fuse:
            monkeypatch.setattr(
                torch_engine,
                "lean_forward",
                lambda m, ops=None: (LeanForward(m, ops, fuse_decode=False), ""),
            )
        engine = TorchStepEngine(model)
        calls = 0
        step = engine._lean._decode_step
        if step is not None:

            def counted(*args: Any) -> Any:
                nonlocal calls
                calls += 1
                return step(*args)

            engine._lean._decode_step = counted
        run_mixed_steps(engine)
        return list(passes), calls

    fused, calls = run(fuse=True)
    plain, none = run(fuse=False)
    assert calls > 0
    assert none == 0
    assert len(fused) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain, strict=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("dim", "rotary"), [(64, 64), (32, 16)])  # whole heads, half (Phi-3)
def test_decode_step_is_its_parts_called_one_by_one(
    ops: Any, dtype: str, dim: int, rotary: int
) -> None:
    """q rotated, each row's k rotated and v copied into column hi of its slot, then the decode
    attention: the bits of rotary, the copies and decode_attention made one by one, and no
    other column of the store touched."""
    gen = torch.Generator().manual_seed(dim + rotary)
    kind = getattr(torch, dtype)
    rows, heads, kv_heads, slots, capacity, hi = 3, 6, 2, 4, 12, 9
    # the fused projection's output as a slice: rows further apart than one row's values
    wide = torch.randn(rows, (heads + 2 * kv_heads + 1) * dim, generator=gen).to(kind)
    qkv = wide[:, : (heads + 2 * kv_heads) * dim]
    cos = torch.randn(rows, 1, rotary, generator=gen).to(kind)
    sin = torch.randn(rows, 1, rotary, generator=gen).to(kind)
    keys = torch.randn(slots, kv_heads, capacity, dim, generator=gen).to(kind)
    values = torch.randn(slots, kv_heads, capacity, dim, generator=gen).to(kind)
    first = torch.tensor([0, 4, 9])
    parts = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    q, k, v = (p.reshape(rows, -1, dim) for p in parts)
    want_keys, want_values = keys.clone(), values.clone()
    want_keys[:rows, :, hi] = ops.rotary(k, cos, sin)
    want_values[:rows, :, hi] = v
    want = ops.rotary(q, cos, sin).contiguous()
    want = torch.ops.batchline.decode_attention(want, want_keys, want_values, first, hi, 0.3)
    out = ops.decode_step(qkv, cos, sin, keys, values, first, hi, 0.3, heads)
    assert torch.equal(keys, want_keys)
    assert torch.equal(values, want_values)
    assert torch.equal(out, want.view(rows, heads * dim))


def test_decode_step_refuses_a_store_of_another_dtype_or_layout(ops: Any) -> None:
    keys = torch.zeros(2, 1, 8, 16)
    cos = sin = torch.ones(2, 1, 16)
    first = torch.zeros(2, dtype=torch.long)
    qkv = torch.zeros(2, (2 + 2 * 1) * 16)
    with pytest.raises(RuntimeError, match="decode_step: qkv, keys and values must have one"):
        ops.decode_step(qkv, cos, sin, keys.bfloat16(), keys.bfloat16(), first, 3, 0.25, 2)
    strided = torch.zeros(2, 1, 16, 16)[:, :, ::2]
    with pytest.raises(RuntimeError, match="decode_step: keys and values must be contiguous"):
        ops.decode_step(qkv, cos, sin, strided, strided.clone(), first, 3, 0.25, 2)
    with pytest.raises(RuntimeError, match=r"decode_step: cos and sin \(tokens, 1, r\)"):
        ops.decode_step(qkv, cos[:1], sin[:1], keys, keys.clone(), first, 3, 0.25, 2)
    with pytest.raises(RuntimeError, match="decode_attention: first"):
        ops.decode_step(qkv, cos, sin, keys, keys.clone(), first + 5, 3, 0.25, 2)


def test_decode_step_refuses_what_does_not_fit_the_store(ops: Any) -> None:
    keys = torch.zeros(2, 1, 8, 16)
    cos = sin = torch.ones(2, 1, 16)
    first = torch.zeros(2, dtype=torch.long)
    qkv = torch.zeros(2, (2 + 2 * 1) * 16)
    out = ops.decode_step(qkv, cos, sin, keys, keys.clone(), first, 3, 0.25, 2)
    assert out.shape == (2, 2 * 16)
    with pytest.raises(RuntimeError, match=r"decode_step: qkv must be \(rows"):
        ops.decode_step(qkv[:, :-16], cos, sin, keys, keys.clone(), first, 3, 0.25, 2)
    with pytest.raises(RuntimeError, match="decode_step: more rows than slots, or hi outside"):
        ops.decode_step(qkv, cos, sin, keys, keys.clone(), first, 8, 0.25, 2)


# Each kind of host the library is built on (with -march=native): AVX2 only, AVX-512 without BF16
# (Ice Lake's: the float32 int4 kernel's), AVX-512 with BF16 and no AMX (Cooper Lake's flags;
# AMD's Zen 4 has the same ones), and AMX. A source that built
# only with AMX's flags once cost the AVX2 and AVX-512 hosts the whole library, silently.
_HOST_KINDS = ("haswell", "icelake-server", "cooperlake", "sapphirerapids")


# 16 compilers (4 kinds x 4 sources), each parsing ATen's headers, share the machine's cores:
# ~2 min on 2 busy cores with the fourth source, past the suite's 120 s default
@pytest.mark.timeout(600)
def test_the_library_sources_compile_for_every_kind_of_host() -> None:
    from torch.utils import cpp_extension

    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    flags = [f for f in dk._FLAGS if f != "-march=native"]
    assert len(flags) == len(dk._FLAGS) - 1  # the build's own flags but the target
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    runs = {
        (kind, source.name): subprocess.Popen(
            [compiler, *flags, f"-march={kind}", *includes, "-fsyntax-only", str(source)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for kind in _HOST_KINDS
        for source in dk._SOURCES
    }
    failed = {}
    for key, run in runs.items():
        _, err = run.communicate(timeout=300)
        if run.returncode != 0:
            failed[key] = err.strip().splitlines()[-3:]
    assert not failed, failed
