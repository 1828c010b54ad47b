"""Image classification against peers: ``batchline run`` over a folder of JPEGs, the
transformers ``pipeline("image-classification")`` and Ray Data, same model and same images, in
one run; the same top-1 labels are checked and the ratios printed.

Images: ``--images`` JPEGs of mixed sizes (0.3-12 megapixels, log-uniform; 4:3, 3:2, 16:9,
1:1 and portrait), generated deterministically from ``--seed`` (smooth colour fields with
noise, so they compress as photographs do). Model: a classifier of a real shape with random
weights, saved as a Hugging Face folder with its processor config: ``vit-s16`` (ViT-S/16,
224 px, 1,000 labels) or ``resnet50`` (ResNet-50, ConvNeXt-style 224 px crop).

Modes, each over all the images, timed from its start (model load included) to the labels:

(a) batchline    ``python -m batchline run IMAGES/ --model MODEL/ --top-k 1`` (the model is
                 converted to ONNX once before timing, by a warm-up run of 8 images);
(b) transformers ``pipeline("image-classification", model=MODEL)`` on the file paths, every
                 ``batch_size`` x ``num_workers`` of the grid tried, the best kept;
(c) ray          ``ray.data.read_images`` + ``map_batches`` with
                 ``compute=ray.data.ActorPoolStrategy(size=N)`` on one machine; each actor
                 preprocesses with the folder's transformers image processor and runs the same
                 ONNX graph as (a) on ONNX Runtime (``--ray-runtime torch``: the transformers
                 model instead), every ``N`` x batch size of the grid tried, the best kept
                 (as in (b): the grid on a subset, the best point on all the pictures).

Goals (issue 50): (a) >= 1.5 x (b) and (a) >= 1.3 x (c), with the same top-1 labels.

Usage::

    python benchmarks/bench_images_peers.py                       # full: 2,000 images
    python benchmarks/bench_images_peers.py --images 24 --quick   # smoke run (~2 min)

Needs ``batchline[jobs]``, torch and transformers (``batchline[generate]``), and Ray Data
(``pip install 'ray[data]'``) for mode (c).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

SHAPES = ("4:3", "3:2", "16:9", "1:1", "3:4")
GOALS = {"transformers": 1.5, "ray": 1.3}


def make_images(folder: Path, count: int, seed: int) -> list[Path]:
    """``count`` JPEGs of 0.3-12 megapixels, the same for the same seed (reused when present)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / f".made-{count}-{seed}"
    paths = [folder / f"{i:05d}.jpg" for i in range(count)]
    if marker.is_file():
        return paths
    rng = np.random.default_rng(seed)
    for path in paths:
        pixels = float(np.exp(rng.uniform(np.log(0.3e6), np.log(12e6))))
        w_ratio, h_ratio = (int(x) for x in SHAPES[int(rng.integers(len(SHAPES)))].split(":"))
        height = int(np.sqrt(pixels * h_ratio / w_ratio))
        width = int(pixels / height)
        # a smooth colour field (a small random image scaled up) with fine noise on top
        field = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(
            (width, height), Image.Resampling.BICUBIC
        )
        noise = rng.integers(-12, 13, (height, width, 1), dtype=np.int16)
        array = np.clip(np.asarray(field, np.int16) + noise, 0, 255).astype(np.uint8)
        Image.fromarray(array).save(path, quality=int(rng.integers(80, 96)))
    marker.touch()
    return paths


def make_model(folder: Path, shape: str) -> Path:
    """A random-weight classifier of a real shape, saved with its processor config."""
    import torch
    import transformers

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    labels = {i: f"class_{i:04d}" for i in range(1000)}
    common = {"id2label": labels, "label2id": {v: k for k, v in labels.items()}}
    if shape == "vit-s16":
        config = transformers.ViTConfig(
            image_size=224,
            patch_size=16,
            hidden_size=384,
            num_hidden_layers=12,
            num_attention_heads=6,
            intermediate_size=1536,
            **common,
        )
        model = transformers.ViTForImageClassification(config)
        processor = transformers.ViTImageProcessorPil(size={"height": 224, "width": 224})
    else:
        config = transformers.ResNetConfig(
            layer_type="bottleneck",
            hidden_sizes=[256, 512, 1024, 2048],
            depths=[3, 4, 6, 3],
            **common,
        )
        model = transformers.ResNetForImageClassification(config)
        processor = transformers.ConvNextImageProcessorPil(
            size={"shortest_edge": 224}, crop_pct=0.875
        )
    model.eval().save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def run_batchline(images: Path, model: Path, out: Path, extra: Sequence[str]) -> dict[str, str]:
    """One ``batchline run`` over ``images``: the top-1 label by file name."""
    command = [sys.executable, "-m", "batchline", "run", f"{images}/", "--model", f"{model}/"]
    command += ["--top-k", "1", "--output", str(out), "--overwrite", *extra]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    import pyarrow.parquet as pq

    labels: dict[str, str] = {}
    for part in sorted(out.glob("*.parquet")):
        table = pq.read_table(part).to_pylist()
        labels.update({Path(str(row["id"])).name: row["classification"]["label"] for row in table})
    return labels


def run_pipeline(paths: list[Path], model: Path, batch_size: int, workers: int) -> dict[str, str]:
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        classify = transformers.pipeline(
            "image-classification", model=str(model), device="cpu", num_workers=workers
        )
        results = classify([str(p) for p in paths], batch_size=batch_size, top_k=1)
    return {p.name: r[0]["label"] for p, r in zip(paths, results, strict=True)}


class _RayClassifier:
    """One Ray actor: the folder's image processor, then the ONNX graph (or the torch model)."""

    def __init__(self, model: str, onnx_file: str | None) -> None:
        import transformers

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.processor = transformers.AutoImageProcessor.from_pretrained(model)
            self.labels = transformers.AutoConfig.from_pretrained(model).id2label
        self.session: Any = None
        self.torch_model: Any = None
        if onnx_file is not None:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            self.session = ort.InferenceSession(onnx_file, options)
        else:
            import torch

            torch.set_num_threads(1)
            self.torch_model = transformers.AutoModelForImageClassification.from_pretrained(
                model
            ).eval()

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        from PIL import Image

        pictures = [Image.fromarray(np.asarray(a, np.uint8)) for a in batch["image"]]
        pixels = self.processor(images=pictures, return_tensors="np")["pixel_values"]
        if self.session is not None:
            logits = self.session.run(None, {"pixel_values": pixels.astype(np.float32)})[0]
        else:
            import torch

            with torch.no_grad():
                logits = self.torch_model(torch.from_numpy(pixels)).logits.numpy()
        best = logits.argmax(-1)
        return {
            "path": np.asarray([Path(p).name for p in batch["path"]]),
            "label": np.asarray([self.labels[int(i)] for i in best]),
        }


def run_ray(
    images: Path, model: Path, onnx_file: str | None, actors: int, batch_size: int
) -> dict[str, str]:
    import ray

    ds = ray.data.read_images(str(images), mode="RGB", include_paths=True)
    rows = ds.map_batches(
        _RayClassifier,
        fn_constructor_args=(str(model), onnx_file),
        compute=ray.data.ActorPoolStrategy(size=actors),
        batch_size=batch_size,
        num_cpus=0.5,  # more actors than logical CPUs would starve the reader (FACTS.md)
    ).take_all()
    return {str(r["path"]): str(r["label"]) for r in rows}


def converted_graph(model: Path) -> str:
    """The ONNX file batchline converted the folder to (the warm-up run made it)."""
    from batchline.models.config import Knobs
    from batchline.models.loader import load_model
    from batchline.models.specs import parse_spec

    loaded: Any = load_model(parse_spec(f"{model}/"), Knobs(sessions=1, intra_op_threads=1))
    return str(loaded.model.path)


def best_of(
    name: str,
    grid: list[tuple[int, int]],
    on_subset: Callable[[tuple[int, int]], dict[str, str]],
    on_all: Callable[[tuple[int, int]], dict[str, str]],
    few: int,
    count: int,
) -> tuple[float, dict[str, str]]:
    """A peer's grid tried on ``few`` pictures (every point printed), then its best point on
    all ``count`` of them: that rate and those labels."""
    best, chosen = 0.0, grid[0]
    for point in grid:
        seconds, _ = timed(lambda p=point: on_subset(p))
        print(f"{name.format(*point):48} {few / seconds:8.1f} images/s on {few}")
        if few / seconds > best:
            best, chosen = few / seconds, point
    seconds, got = timed(lambda: on_all(chosen))
    print(f"{name.format(*chosen):48} {count / seconds:8.1f} images/s on all {count}")
    return count / seconds, got


def linked_subset(paths: list[Path], folder: Path) -> Path:
    """A folder of links to ``paths`` (a folder reader then reads only those)."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in paths:
        link = folder / path.name
        if not link.exists():
            link.symlink_to(path.resolve())
    return folder


def timed(fn: Callable[[], dict[str, str]]) -> tuple[float, dict[str, str]]:
    start = time.perf_counter()
    labels = fn()
    return time.perf_counter() - start, labels


def agreement(a: dict[str, str], b: dict[str, str]) -> str:
    same = sum(a.get(k) == v for k, v in b.items())
    return f"{same}/{len(b)} same top-1" + ("" if len(a) == len(b) else f" ({len(a)} vs {len(b)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=["vit-s16", "resnet50"], default="vit-s16")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/batchline-bench-images"))
    parser.add_argument("--modes", default="batchline,transformers,ray")
    parser.add_argument("--ray-runtime", choices=["onnx", "torch"], default="onnx")
    parser.add_argument("--quick", action="store_true", help="one point per grid (smoke)")
    parser.add_argument(
        "--grid-images",
        type=int,
        default=200,
        help="the peers' settings are tried on this many pictures, the best then on all",
    )
    parser.add_argument(
        "--full-decode",
        action="store_true",
        help="also run batchline with --no-draft: its labels against the peers' full decodes",
    )
    parser.add_argument(
        "--run-args", default="", help="more flags for batchline run (e.g. '--sessions 2')"
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    images_dir = args.workdir / f"images-{args.images}-{args.seed}"
    paths = make_images(images_dir, args.images, args.seed)
    model = make_model(args.workdir / f"model-{args.shape}", args.shape)
    megapixels = sum(_pixels(p) for p in paths) / 1e6
    print(f"{len(paths)} JPEGs, {megapixels / len(paths):.1f} MP mean; model {args.shape}")
    rates: dict[str, float] = {}
    labels: dict[str, dict[str, str]] = {}
    if "batchline" in modes:
        warm = args.workdir / "warm"
        warm_dir = args.workdir / "warm-images"
        make_images(warm_dir, 8, args.seed + 1)
        run_batchline(warm_dir, model, warm, [])  # converts the model once, off the clock
        seconds, labels["batchline"] = timed(
            lambda: run_batchline(images_dir, model, args.workdir / "out", args.run_args.split())
        )
        rates["batchline"] = len(paths) / seconds
        print(f"(a) batchline run        {rates['batchline']:8.1f} images/s")
        if args.full_decode:  # the same labels as the peers' full decodes, and at what rate
            seconds, labels["batchline --no-draft"] = timed(
                lambda: run_batchline(
                    images_dir,
                    model,
                    args.workdir / "out-full",
                    [*args.run_args.split(), "--no-draft"],
                )
            )
            print(f"(a') batchline --no-draft {len(paths) / seconds:8.1f} images/s")
    subset = paths[: min(args.grid_images, len(paths))]
    if "transformers" in modes:
        grid = [(16, 2)] if args.quick else [(8, 0), (16, 0), (32, 0), (8, 2), (16, 2), (32, 2)]

        def pipeline_on(on: list[Path]) -> Callable[[tuple[int, int]], dict[str, str]]:
            return lambda point: run_pipeline(on, model, *point)

        rates["transformers"], labels["transformers"] = best_of(
            "(b) transformers batch_size={} num_workers={}", grid, pipeline_on(subset),
            pipeline_on(paths), len(subset), len(paths),
        )  # fmt: skip
    if "ray" in modes:
        import ray

        onnx_file = converted_graph(model) if args.ray_runtime == "onnx" else None
        ray.init(
            num_cpus=os.cpu_count() or 2,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        ray.data.DataContext.get_current().enable_progress_bars = False
        # not 3 actors on 2 CPUs: at 0.5 CPU each they leave no whole CPU for the read tasks,
        # and Ray Data's executor waited 24 minutes without a row (2026-12-02)
        grid = [(2, 16)] if args.quick else [(1, 16), (2, 16), (2, 32)]
        few = linked_subset(subset, args.workdir / f"subset-{len(subset)}-{args.seed}")

        def ray_on(folder: Path) -> Callable[[tuple[int, int]], dict[str, str]]:
            return lambda point: run_ray(folder, model, onnx_file, *point)

        try:
            rates["ray"], labels["ray"] = best_of(
                "(c) ray actors={} batch_size={}", grid, ray_on(few), ray_on(images_dir),
                len(subset), len(paths),
            )  # fmt: skip
        finally:
            ray.shutdown()
    if "batchline" in rates:
        for peer, goal in GOALS.items():
            if peer in rates:
                ratio = rates["batchline"] / rates[peer]
                same = agreement(labels["batchline"], labels[peer])
                print(f"batchline / {peer:12} x{ratio:.2f} (goal x{goal}); {same}")
                if "batchline --no-draft" in labels:
                    same = agreement(labels["batchline --no-draft"], labels[peer])
                    print(f"  batchline --no-draft against {peer}: {same}")
    print(json.dumps({"rates": rates, "images": len(paths), "shape": args.shape}))


def _pixels(path: Path) -> int:
    from PIL import Image

    with Image.open(path) as im:
        return int(im.size[0] * im.size[1])


if __name__ == "__main__":
    main()
