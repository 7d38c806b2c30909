"""Make examples/models/tiny-llama: the small Hugging Face Llama that examples/finetune.yaml starts from.

No model can be downloaded here, so the example ships its own "pretrained" checkpoint, made as a user's base model
would have been: a byte-level BPE tokenizer (1024 tokens, `<|endoftext|>` as EOS) trained with the tokenizers
library, and a 2-layer Llama (hidden 64, 2 query heads sharing 1 key/value head: head_dim 32, which vLLM's CPU
attention serves; 64 positions) trained by transformers for a few hundred steps on the Python standard library's
documentation past the first 300 kB. The fine-tune example then trains on the first 300 kB (its own
data.prepare), text the base model has not seen. Saved as transformers saves any model (config.json,
generation_config.json, model.safetensors) with tokenizer.json and tokenizer_config.json beside it.

    python examples/models/make_tiny_llama.py [--out examples/models/tiny-llama] [--steps 400]

Deterministic for a given Python (its pydoc topics are the corpus) and torch; about a minute on two cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SEQ_LEN = 64
VOCAB = 1024
EOS = "<|endoftext|>"
FINETUNE_BYTES = 300_000
"""examples/finetune.yaml's data.prepare.builtin_max_bytes: the base model trains on what comes after."""
PRETRAIN_BYTES = 1_500_000


def corpus() -> list[str]:
    """The standard library's documentation past the fine-tune example's share."""
    from tasks.prepare.corpus import stdlib_documents

    seen, texts = 0, []
    for text in stdlib_documents(PRETRAIN_BYTES, min_chars=32):
        if seen >= FINETUNE_BYTES:
            texts.append(text)
        seen += len(text.encode("utf-8"))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "tiny-llama")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    torch.set_num_threads(2)
    texts = corpus()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    eos_id = tokenizer.token_to_id(EOS)
    ids = [i for text in texts for i in [*tokenizer.encode(text).ids, eos_id]]
    samples = torch.tensor(ids[: len(ids) // (SEQ_LEN + 1) * (SEQ_LEN + 1)]).view(-1, SEQ_LEN + 1)
    print(f"{len(texts)} documents, {len(ids):,} tokens, {len(samples)} samples of {SEQ_LEN + 1}")

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=SEQ_LEN, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=eos_id, eos_token_id=eos_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=args.steps, pct_start=0.05)
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0))
    batch = 16
    for step in range(args.steps):
        rows = order[(step * batch) % len(order) :][:batch]
        tokens = samples[rows]
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f}")

    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config.max_length = None  # no fixed length: generate(max_new_tokens=...) alone decides
    model.save_pretrained(args.out)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS).save_pretrained(args.out)
    (args.out / "README.md").write_text(
        "---\nlibrary_name: transformers\npipeline_tag: text-generation\n---\n\n# tiny-llama\n\n"
        "The base model of examples/finetune.yaml, made by examples/models/make_tiny_llama.py (read it for how): "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, final pretraining loss {loss.item():.3f}.\n"
    )
    print(json.dumps({"out": str(args.out), "loss": round(loss.item(), 4)}))


if __name__ == "__main__":
    main()
