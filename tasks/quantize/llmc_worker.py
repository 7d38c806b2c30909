"""Quantize a Hugging Face model folder with LLM Compressor (run by tasks/quantize/quantizer.py, in .venv-quant).

LLM Compressor pins its own transformers (0.14: transformers<=5.17), so it runs in an environment of its own
and this script imports nothing of the project: it reads one JSON request (the source and target folders, the
scheme, the method and the calibration token ids) and writes the compressed-tensors checkpoint that vLLM loads.

    python llmc_worker.py REQUEST.json
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

# Files of the source folder the quantized one ships unchanged (the weights and config.json are rewritten).
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def main(request_path: str) -> None:
    """Quantize the request's source folder into its target folder (which must not exist yet)."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM

    request = json.loads(Path(request_path).read_text())
    src, dst = Path(request["src"]), Path(request["dst"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, trust_remote_code=False)
    # lm_head stays unquantized: vLLM's quantized lm_head is GPU-only and the logits are where errors show most
    modifier = GPTQModifier if request["method"] == "gptq" else QuantizationModifier
    recipe = modifier(targets="Linear", scheme=request["scheme"], ignore=["lm_head"])
    calibration = request["calibration"]
    if request["method"] == "gptq":
        dataset = Dataset.from_dict({"input_ids": calibration, "attention_mask": [[1] * len(s) for s in calibration]})
        oneshot(
            model=model, dataset=dataset, recipe=recipe, max_seq_length=max(len(s) for s in calibration),
            num_calibration_samples=len(calibration),
        )  # fmt: skip
    else:
        oneshot(model=model, recipe=recipe)
    model.save_pretrained(dst, save_compressed=True)
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


if __name__ == "__main__":
    main(sys.argv[1])
