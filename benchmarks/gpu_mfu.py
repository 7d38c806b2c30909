"""Tokens/s and MFU of the payload's training step for a ~1B dense model on one GPU in bf16.

The step is the trainer's (training/model.py's Transformer, autocast bf16, the cross-entropy in fp32, gradient
clipping, build_optimizer's AdamW: fused on GPUs), with the blocks compiled as run.compile does; the host reads
the loss only every --sync-every steps, as run.metrics_sync_every_steps does on GPUs. MFU is the model FLOPs
per token (Narayanan et al. 2021 eq. 3, the capacity planner's `flops_per_token`) times tokens/s over the
accelerator's dense bf16 peak (the planner's catalogue, or --peak-tflops). Goal: MFU >= 50% on an H100/H200
(torchtitan reports 33-39% for Llama 3 8B without float8).

--fp8 converts the blocks' Linear layers to float8 first, with the trainer's own function (training/float8.py:
torchao, rowwise scaling, precision.dtype fp8); its MFU is still over the dense bf16 peak, so that the two runs
compare (bf16 first, then --fp8, on the same GPU). fp8 needs CUDA compute capability 8.9+: elsewhere, --smoke
included, it prints the trainer's refusal and exits 1.

On a machine without a GPU it says so and measures nothing, unless --smoke runs a tiny model on the CPU (to
check that the script itself works; its MFU means nothing).

Usage: python benchmarks/gpu_mfu.py [--steps 30] [--micro-batch 4] [--seq 2048] [--no-compile] [--fp8] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from tasks.capacity.catalogue import CATALOGUE
from tasks.capacity.compute import flops_per_token
from tasks.capacity.params import Architecture
from training.config import ModelConfig, OptimConfig
from training.float8 import Float8Unavailable, convert_blocks, require_float8_device
from training.model import Transformer, blocks_of
from training.train import build_optimizer

GOAL_MFU = 0.50
ONE_B = {"n_layers": 18, "d_model": 2048, "n_heads": 16, "n_kv_heads": 8, "ffn_hidden": 5632, "vocab_size": 32000}
TINY = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 172, "vocab_size": 257}


def accelerator_peak(name: str) -> tuple[str, float]:
    """(catalogue entry, dense bf16 peak FLOP/s) of the GPU this runs on, by its CUDA device name."""
    lowered = name.lower()
    for key, entry in (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80gb"), ("b200", "b200")):
        if key in lowered:
            return entry, CATALOGUE[entry].peak_tflops_bf16 * 1e12
    return "", 0.0


def main() -> int:
    """Measure and print tokens/s and MFU; exit 0 (1 when no GPU and no --smoke)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens there)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--sync-every", type=int, default=10, help="host reads of the loss, every N steps")
    parser.add_argument("--no-compile", action="store_true", help="eager blocks")
    parser.add_argument("--fp8", action="store_true", help="the blocks' Linear layers in float8 (precision fp8)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if unknown")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script only")
    args = parser.parse_args()

    if not torch.cuda.is_available() and not args.smoke:
        print("no GPU here: nothing measured (run it on a GPU machine; --smoke checks the script on the CPU)")
        return 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shape, seq = (TINY, 64) if args.smoke else (ONE_B, args.seq)
    cfg = ModelConfig(**shape, seq_len=seq)
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    if args.fp8:  # as the trainer does: refused below compute capability 8.9, converted before compile
        try:
            require_float8_device(device)
        except Float8Unavailable as err:
            print(f"fp8 refused: {err}")
            return 1
        convert_blocks(blocks_of(model))
    compiled = not args.no_compile and device.type == "cuda"
    if compiled:
        for block in blocks_of(model):
            block.compile()
    optimizer = build_optimizer(model, OptimConfig(lr_peak=3e-4), device.type)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch, seq + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    dtype = torch.bfloat16

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype):
            logits, _ = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    losses = []
    windows = []
    done = 0
    while done < args.steps:
        n = min(args.sync_every, args.steps - done)
        started = time.perf_counter()
        pending = [step() for _ in range(n)]
        losses += torch.stack(pending).tolist()  # one host read per window, as the trainer does
        windows.append((time.perf_counter() - started) / n)
        done += n
    step_s = statistics.median(windows)
    tok_s = args.micro_batch * seq / step_s
    arch = Architecture.from_model_config(cfg)
    per_token = flops_per_token(arch, "none").model
    params = sum(p.numel() for p in model.parameters())
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        entry, peak = accelerator_peak(name)
        peak = args.peak_tflops * 1e12 if args.peak_tflops else peak
        memory = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        name, entry, peak, memory = "cpu (smoke)", "cpu", CATALOGUE["cpu"].peak_tflops_bf16 * 1e12, 0.0
    mfu = per_token * tok_s / peak if peak else float("nan")
    print(
        f"{name} ({entry or 'unknown: give --peak-tflops'}): {params / 1e9:.2f}B params, micro-batch "
        f"{args.micro_batch} x {seq} tokens, bf16 autocast{' + fp8 blocks' if args.fp8 else ''}, "
        f"{'compiled' if compiled else 'eager'} blocks, "
        f"fused AdamW={optimizer.defaults.get('fused')}"
    )
    print(
        f"step {step_s * 1e3:.1f} ms (median of {len(windows)} windows), {tok_s:,.0f} tokens/s, model FLOPs "
        f"{per_token:.3g}/token, MFU {mfu:.1%} (goal >= {GOAL_MFU:.0%}: {'met' if mfu >= GOAL_MFU else 'MISSED'}), "
        f"peak memory {memory:.1f} GiB, last loss {losses[-1]:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
