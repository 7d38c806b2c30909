"""benchmarks/vision.py's own pieces: the training config it compares on, the bare loop, and the table."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.vision import CLASSES, bare_run, colour_images, print_table, verdict, vit_config

ARGS = argparse.Namespace(image_size=16, patch=4, layers=1, d_model=32, batch=4, steps=2, threads=1)


def test_a_ratio_is_met_up_to_its_goal() -> None:
    assert verdict(0.8, 0.8).endswith("met)") and "NOT met" in verdict(0.79, 0.8)


def test_the_compared_config_is_a_vit_of_the_command_lines_sizes(tmp_path: Path) -> None:
    cfg = vit_config(tmp_path, str(tmp_path / "images"), ARGS, "t", save=True)
    assert cfg.model.kind == "vit" and cfg.model.vision is not None
    assert (cfg.model.vision.image_size, cfg.model.vision.patch_size, cfg.model.vision.num_classes) == (16, 4, CLASSES)
    assert cfg.model.seq_len == (16 // 4) ** 2 + 1  # image tokens: the patches and the class token
    assert (cfg.parallel.micro_batch, cfg.run.steps, cfg.run.threads_per_rank) == (4, 2, 1)
    assert cfg.checkpoint.save_at_end and not vit_config(tmp_path, "x", ARGS, "u").checkpoint.save_at_end


def test_the_bare_loop_trains_on_images_in_memory_and_takes_cpu_time(tmp_path: Path) -> None:
    images, labels = colour_images(np.random.default_rng(0), 8, 16)
    assert images.shape == (8, 16, 16, 3) and set(labels) <= set(range(CLASSES))
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    cpu_s, wall_s = bare_run(vit_config(tmp_path, "x", ARGS, "t"), pixels, torch.from_numpy(labels))
    assert cpu_s > 0 and wall_s > 0


def test_the_table_prints_every_part_with_its_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    data = {"n_images": 10, "source_px": [256, 192], "image_size_px": 64, "rounds": [{}],
            "bare_pillow_images_per_cpu_s": 400.0, "step_1_worker_images_per_cpu_s": 360.0,
            "bare_pillow_images_per_s": 390.0, "step_1_worker_images_per_s": 350.0,
            "step_2_workers_images_per_s": 600.0, "step_validated_images_per_s": 50.0,
            "ratio_step_over_bare": 0.9, "ratio_step_over_bare_wall": 0.89, "goal_ratio": 0.8}  # fmt: skip
    train = {"params": 114_000, "image_tokens": 17, "batch": 32, "steps": 40, "threads": 1,
             "trainer_images_per_cpu_s": 1900.0, "trainer_images_per_s": 600.0, "bare_images_per_cpu_s": 2000.0,
             "bare_images_per_s": 700.0, "ratio_cpu": 0.95, "ratio_wall": 0.86, "goal_ratio": 0.97}  # fmt: skip
    serve = [{"server": "classifier (transformers)", "images": 64, "concurrency": 4, "p50_ms": 60.0,
              "p99_ms": 400.0, "images_per_s": 37.0, "accuracy": 1.0, "top1_match": 1.0},
             {"server": "VLM", "images": 8, "concurrency": 2, "p50_ms": 100.0, "p99_ms": 160.0,
              "images_per_s": 14.0, "greedy_match": 1.0}]  # fmt: skip
    print_table({"data": data, "train": train, "serve": serve})
    out = capsys.readouterr().out
    assert "ratio step / bare (1 worker, CPU time): 0.90 (goal >= 0.80: met)" in out
    assert "ratio Trainer / bare (CPU time): 0.95 (goal >= 0.97: NOT met)" in out
    assert "accuracy 1.00, top-1 = transformers 1.00" in out and "greedy parity 1.00" in out
