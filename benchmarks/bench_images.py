"""Image jobs end to end: decode off the model's path, measured as ratios in one run.

2,000 JPEGs of mixed sizes (0.3 to 12 megapixels, drawn from a fixed seed, written once to
``--workdir``) go through ``batchline run`` three ways:

1. **No idle time.** The decode rate ``D`` (the job's decode pool alone, every core decoding:
   read, decode with draft, preprocess to 224 x 224, pixels back, on a sample) and the model's
   rate ``R`` (its batches alone, in the job's session layout, on pictures already
   preprocessed) are measured first. Each alone takes the whole machine, so together they
   allow ``1 / (1/D + 1/R)`` pictures per second; ``run`` end to end must reach >= 0.9 of that.
2. **The device kept busy.** A stand-in device (``bench_images:standin``, a ``module:factory``
   model) sleeps ``a + b * batch`` with the GIL released, ``b`` set so that even its largest
   batches run at 0.8 of what the decode workers deliver (they can keep up): it must be busy
   >= 95% of the job's wall time.
3. **Memory.** The pictures listed in a CSV (``--image-column``) repeated to 1,000 and to
   10,000 rows, run in a child process on a fast stand-in (duplicates not skipped): the peak
   RSS of the whole process tree (the job and its decode workers, sampled) must stay within
   10% from the one to the other.

Model shapes (``--model``): ``vit-s16`` (ViT-S/16, 1,000 classes, random weights; needs torch
and transformers to export it once), ``resnet50`` (the same for ResNet-50), ``tiny`` (a 3-layer
convolution built with onnx.helper: for smoke runs).

Usage::

    python benchmarks/bench_images.py                                  # full size, ViT-S/16
    python benchmarks/bench_images.py --images 24 --model tiny --memory-images 30,60   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from batchline.jobs.options import RunOptions
from batchline.jobs.run import run
from batchline.models.config import Knobs
from batchline.models.image import ImageOptions, ImagePreprocess, ImageRef
from batchline.models.image.onnx_image import flag_preprocess
from batchline.models.protocol import ModelInfo

SIDE = 224
PREPROCESS = flag_preprocess(ImageOptions(size=SIDE), None)

# -- the pictures ----------------------------------------------------------------------------


def make_images(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` JPEGs of 0.3 to 12 megapixels (log-uniform), several aspect ratios, smooth
    shapes and fine detail (a photograph's spread of JPEG sizes), written once."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        path = folder / f"img_{i:05d}.jpg"
        paths.append(path)
        megapixels = float(np.exp(rng.uniform(np.log(0.3), np.log(12.0))))
        aspect = float(rng.choice([4 / 3, 3 / 2, 1.0, 3 / 4, 16 / 9]))
        width = max(16, round((megapixels * 1e6 * aspect) ** 0.5))
        height = max(16, round(megapixels * 1e6 / width))
        coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
        fine = rng.integers(0, 256, size=(90, 120, 3), dtype=np.uint8)
        if path.exists():
            continue  # drawn anyway, so that the next picture's numbers do not move
        base = Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)
        detail = Image.fromarray(fine).resize((width, height), Image.Resampling.BILINEAR)
        Image.blend(base, detail, 0.25).save(path, "JPEG", quality=88)
    return paths


def picture_folder(work: Path, count: int) -> tuple[list[Path], Path]:
    """``count`` of :func:`make_images`' pictures (made in ``work/images``, which keeps every
    picture any count made) and a folder ``work/images-COUNT`` of links to exactly those."""
    pictures = make_images(work / "images", count)
    folder = work / f"images-{count}"
    folder.mkdir(exist_ok=True)
    for picture in pictures:
        link = folder / picture.name
        if not link.exists():
            link.symlink_to(picture)
    return pictures, folder


# -- the models ------------------------------------------------------------------------------


def build_model(kind: str, folder: Path) -> Path:
    """The classifier's ``.onnx`` (built once per kind): one ``pixel_values`` input
    ``(batch, 3, 224, 224)``, ``logits`` ``(batch, 1000)``."""
    path = folder / f"{kind}.onnx"
    if path.exists():
        return path
    if kind == "tiny":
        return _tiny(path)
    import torch
    import transformers

    if kind == "vit-s16":
        config: Any = transformers.ViTConfig(
            hidden_size=384,
            num_hidden_layers=12,
            num_attention_heads=6,
            intermediate_size=1536,
            image_size=SIDE,
            patch_size=16,
            num_labels=1000,
        )
        model: Any = transformers.ViTForImageClassification(config)
    elif kind == "resnet50":
        model = transformers.ResNetForImageClassification(
            transformers.ResNetConfig(num_labels=1000)
        )
    else:
        raise SystemExit(f"unknown model kind {kind!r}: vit-s16, resnet50 or tiny")
    model.eval()

    class Logits(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values: Any) -> Any:
            return self.inner(pixel_values=pixel_values).logits

    torch.onnx.export(
        Logits(model),
        (torch.zeros(1, 3, SIDE, SIDE),),
        str(path),
        input_names=["pixel_values"],
        output_names=["logits"],
        dynamic_axes={"pixel_values": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    return path


def _tiny(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.normal(size=(32, 3, 8, 8)).astype(np.float32), "cw"),
        numpy_helper.from_array(rng.normal(size=(1000, 32)).astype(np.float32), "gw"),
        numpy_helper.from_array(np.zeros(1000, np.float32), "gb"),
    ]
    nodes = [
        helper.make_node("Conv", ["pixel_values", "cw"], ["c"], strides=[4, 4]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "gw", "gb"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [
            helper.make_tensor_value_info(
                "pixel_values", TensorProto.FLOAT, ["batch", 3, SIDE, SIDE]
            )
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1000])],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


# -- the stand-in device ---------------------------------------------------------------------


class StandIn:
    """A device that takes ``a + b * len(batch)`` seconds a batch, sleeping (the GIL
    released), and counts its busy seconds."""

    preprocess: ImagePreprocess = PREPROCESS

    def __init__(self, a: float, b: float) -> None:
        self.a, self.b = a, b
        self.busy_s = 0.0
        self.batches = 0
        self.info = ModelInfo(
            name="standin", task="embed", input_kind="image", result_kind="vector"
        )

    def prepare(self, inputs: list[object]) -> list[object]:
        return list(inputs)

    def cost(self, item: object) -> int:
        return 1

    def run_batch(self, batch: list[np.ndarray]) -> list[np.ndarray]:
        started = time.perf_counter()
        time.sleep(self.a + self.b * len(batch))
        self.busy_s += time.perf_counter() - started
        self.batches += 1
        return [np.full(4, float(x.mean()), np.float32) for x in batch]

    def encode(self, result: object) -> object:
        return result

    def close(self) -> None:
        pass


#: The last stand-in the factory made (this process reads its busy seconds).
LAST: list[StandIn] = []


def standin() -> StandIn:
    """``bench_images:standin``: a and b from ``BENCH_DEVICE_A``/``BENCH_DEVICE_B`` (seconds)."""
    device = StandIn(float(os.environ["BENCH_DEVICE_A"]), float(os.environ["BENCH_DEVICE_B"]))
    LAST.append(device)
    return device


# -- the measurements ------------------------------------------------------------------------


def decode_rate(paths: list[Path], sample: int) -> float:
    """Pictures per second the job's decode pool delivers with every core decoding (read,
    decode with draft, preprocess, the pixels sent back to this process), no model running.

    Measured through :class:`DecodePool` itself, not one picture after another in this
    process: on these hosts a decode that runs beside another (two workers, or a worker and
    the model) takes ~1.6x its time alone (6.6 against 11 ms a picture, 2026-12-02), and the
    pixels' trip back costs this process too; a cost measured alone would promise a rate
    that the machine cannot give."""
    from batchline.models.image import DecodeOptions, DecodePool

    chosen = paths[:sample]
    cores = os.cpu_count() or 1

    async def go() -> float:
        async with DecodePool(PREPROCESS, DecodeOptions(workers=cores)) as pool:
            warm = [pool.decode(ImageRef(path=str(p))) for p in chosen[: 2 * cores]]
            await asyncio.gather(*warm)
            started = time.perf_counter()
            await asyncio.gather(*(pool.decode(ImageRef(path=str(p))) for p in chosen))
            return len(chosen) / (time.perf_counter() - started)

    return asyncio.run(go())


def model_rate(model_path: Path, knobs: Knobs, pictures: int) -> float:
    """Pictures per second of the model alone, in the job's layout (its batcher, its
    sessions), on preprocessed pictures: the best over a few batch sizes.

    The batch size is capped for this measurement: pictures submitted all at once would
    otherwise form one batch on one session while the others idle, and the rate would be one
    session's, not the layout's (the job's pictures arrive over time and spread over all of
    them)."""
    from batchline.models.batching import ModelBatcher
    from batchline.models.loader import load_model

    spec = RunOptions(model=str(model_path), image_size=SIDE).parse_spec(None)
    model = load_model(spec, knobs)
    rng = np.random.default_rng(1)
    items = [rng.standard_normal((3, SIDE, SIDE), dtype=np.float32) for _ in range(32)]

    async def go(batch: int) -> float:
        capped = knobs.replace(max_batch_size=batch)
        async with ModelBatcher(model, capped) as engine:
            warm = [await engine.submit(items[i % 32]) for i in range(2 * batch * knobs.sessions)]
            await asyncio.gather(*warm)
            started = time.perf_counter()
            futures = [await engine.submit(items[i % 32]) for i in range(pictures)]
            await asyncio.gather(*futures)
            return pictures / (time.perf_counter() - started)

    try:
        rates = {batch: asyncio.run(go(batch)) for batch in (8, 16, 32)}
    finally:
        model.close()
    best = max(rates, key=rates.__getitem__)
    print("model alone by batch size: "
          + ", ".join(f"{b}: {r:.1f}/s" for b, r in rates.items()) + f" (best {best})")  # fmt: skip
    return rates[best]


def job(images: Path, model: str, out: Path, knobs: Knobs, **more: Any) -> Any:
    """``batchline run`` over ``images``, in this process: its summary."""
    return run(
        RunOptions(input=images, output=out, model=model, overwrite=True, knobs=knobs, **more)
    )


def part_idle(
    args: argparse.Namespace, images: Path, paths: list[Path], model: Path
) -> dict[str, float]:
    knobs = Knobs()
    decode = decode_rate(paths, min(len(paths), args.sample))
    rate = model_rate(model, knobs, args.model_pictures)
    # each alone takes the whole machine: a picture costs 1/decode + 1/rate of its time
    allowed = 1 / (1 / decode + 1 / rate)
    summary = job(images, str(model), args.workdir / "out-idle", knobs)
    got = summary.records_per_s
    print(f"decode alone: {decode:.1f} pictures/s, every core decoding")
    print(f"model alone: {rate:.1f} pictures/s ({model.stem}, {knobs.sessions} sessions)")
    print(f"allowed together: {allowed:.1f}/s; run end to end: {got:.1f}/s")
    print(f"  {summary.time_split}; {summary.avg_batch_size:.1f} pictures a batch")
    print(f"NO IDLE TIME: run / allowed = {got / allowed:.2f} (goal >= 0.90)")
    return {"decode_rate": decode, "model_rate": rate, "allowed": allowed, "run_rate": got,
            "ratio": got / allowed}  # fmt: skip


def part_device(args: argparse.Namespace, images: Path, paths: list[Path]) -> dict[str, float]:
    decode = decode_rate(paths, min(len(paths), args.sample))
    a = 0.005
    b = 1 / (0.8 * decode)  # even an endless batch runs at 0.8 of the decode rate
    os.environ["BENCH_DEVICE_A"], os.environ["BENCH_DEVICE_B"] = str(a), str(b)
    sys.path.insert(0, str(Path(__file__).parent))
    knobs = Knobs(sessions=1, max_concurrent_batches=1, max_batch_size=64)
    summary = job(images, "bench_images:standin", args.workdir / "out-device", knobs)
    import bench_images  # the module the factory was imported as

    device = bench_images.LAST[-1]
    busy = device.busy_s / summary.wall_s
    print(f"stand-in device: {a * 1e3:.1f} ms + {b * 1e3:.2f} ms/picture (decode ~{decode:.0f}/s)")
    print(f"  {summary.records} pictures in {summary.wall_s:.1f} s, {device.batches} batches, "
          f"avg {summary.avg_batch_size:.1f}; {summary.time_split}")  # fmt: skip
    print(f"DEVICE KEPT BUSY: {busy:.1%} of the wall time (goal >= 95%)")
    return {"a": a, "b": b, "busy": busy, "wall_s": summary.wall_s}


CHILD = r"""
import os, sys, threading, time, json
import psutil
sys.path.insert(0, sys.argv[4])
from pathlib import Path
from batchline.jobs.options import RunOptions
from batchline.jobs.run import run
from batchline.models.config import Knobs

me = psutil.Process()
peak = [0]
stop = threading.Event()

def sample():
    while not stop.is_set():
        total = 0
        for p in [me, *me.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        peak[0] = max(peak[0], total)
        time.sleep(0.1)

t = threading.Thread(target=sample, daemon=True)
t.start()
summary = run(RunOptions(input=Path(sys.argv[1]), output=Path(sys.argv[2]), overwrite=True,
    model="bench_images:standin", image_column="image", dedupe=False,
    knobs=Knobs(sessions=1, max_concurrent_batches=1, max_batch_size=64)))
stop.set(); t.join()
print(json.dumps({"peak_rss": peak[0], "records": summary.records, "wall_s": summary.wall_s}))
"""


def part_memory(args: argparse.Namespace, paths: list[Path]) -> dict[str, float]:
    env = {**os.environ, "BENCH_DEVICE_A": "0.001", "BENCH_DEVICE_B": "0.0001"}
    peaks = {}
    for rows in args.memory_images:
        csv = args.workdir / f"list-{rows}.csv"
        csv.write_text("image\n" + "".join(f"{paths[i % len(paths)]}\n" for i in range(rows)))
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(csv), str(args.workdir / f"out-mem-{rows}"), "",
             str(Path(__file__).parent)],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        got = json.loads(out.stdout.strip().splitlines()[-1])
        peaks[rows] = got["peak_rss"]
        mib = got["peak_rss"] / 2**20
        print(f"memory: {rows:,} pictures, peak RSS (job + workers) {mib:.0f} MiB"
              f" ({got['records']:,} in {got['wall_s']:.1f} s)")  # fmt: skip
    low, high = min(peaks), max(peaks)
    ratio = peaks[high] / peaks[low]
    print(f"MEMORY: peak at {high:,} / at {low:,} = {ratio:.3f} (goal <= 1.10)")
    return {"ratio": ratio, **{f"peak_{k}": float(v) for k, v in peaks.items()}}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--model", default="vit-s16", help="vit-s16, resnet50 or tiny")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench_images")
    p.add_argument("--sample", type=int, default=200, help="pictures decoded to measure d")
    p.add_argument("--model-pictures", type=int, default=256, help="pictures to time the model on")
    p.add_argument("--parts", default="idle,device,memory")
    p.add_argument(
        "--memory-images", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 10000]
    )
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    images = args.workdir / f"images-{args.images}"
    print(f"host: {os.cpu_count()} cores; pictures in {images}")
    paths = make_images(images, args.images)
    figures: dict[str, Any] = {"images": args.images, "model": args.model}
    parts = args.parts.split(",")
    if "idle" in parts:
        model = build_model(args.model, args.workdir)
        figures["idle"] = part_idle(args, images, paths, model)
    if "device" in parts:
        figures["device"] = part_device(args, images, paths)
    if "memory" in parts:
        figures["memory"] = part_memory(args, paths)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
