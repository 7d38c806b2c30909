"""Checkpoints exported as Hugging Face model folders: logits parity under transformers, shards, refusals,
tokenizers, step selection and the folder's completeness."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tasks.errors import UserError
from tasks.export import hf
from tasks.export.hf import ExportError, hf_config, hf_name
from tasks.export.step import EXPORT_RECORD, PARTIAL_PREFIX, export_checkpoint
from tasks.prepare.config import TokenizerConfig
from tasks.prepare.tokenizer import TextTokenizer, train_bpe
from training.checkpoint import COMMIT, KEY_ENV, MODEL_CARD, CardTokenizer, CheckpointManager, ModelCard, step_dir_name
from training.config import ModelConfig, TrainConfig
from training.model import Transformer
from training.storage import StorageConfig

transformers = pytest.importorskip("transformers")

DENSE_GQA = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 96, "vocab_size": 300}
TIED = {**DENSE_GQA, "n_heads": 2, "n_kv_heads": 1, "tie_embeddings": True, "rope_theta": 500.0, "norm_eps": 1e-6}
MOE = {**DENSE_GQA, "moe": {"n_experts": 4, "top_k": 2}}
TEXTS = ["def f(x):\n    return x * 2  # doubled", "héllo wörld 日本 🎉", "a<|endoftext|>b  \n\t", ""]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    transformers.utils.logging.disable_progress_bar()


def model_config(fields: dict[str, Any]) -> ModelConfig:
    return ModelConfig(seq_len=16, **fields)


def train_config(tmp_path: Path, model: ModelConfig, capacity_factor: float | None = None) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "model": model.model_dump(),
            "parallel": {"micro_batch": 2, "expert_capacity_factor": capacity_factor},
            "optim": {"lr_peak": 1e-3},
            "data": {"dataset_url": str(tmp_path / "dataset")},
            "checkpoint": {"url": str(tmp_path / "checkpoints")},
            "run": {"steps": 10, "output_url": str(tmp_path / "output")},
        }
    )


def bytes_card(model: ModelConfig, **extra: Any) -> ModelCard:
    tokenizer = CardTokenizer(kind="bytes")
    return ModelCard(model=model, vocab_size=257, eos_id=256, dataset_url="/d", tokenizer=tokenizer, **extra)


def save_checkpoints(train: TrainConfig, card: ModelCard | None, *steps: int, seed: int = 0) -> Transformer:
    """Our model, random-initialised (norm weights too, so a misplaced norm shows), saved at each of `steps`."""
    torch.manual_seed(seed)
    model = Transformer(train.model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = CheckpointManager(train.checkpoint, train.storage, card=card.model_dump(mode="json") if card else None)
    for step in steps:
        manager.save(step, model, optimizer, {"step": step})
    return model.eval()


def hf_logits(model_dir: str | Path, ids: torch.Tensor) -> torch.Tensor:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        return loaded.eval()(ids).logits


def our_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)[0]


@pytest.mark.parametrize(
    ("fields", "architecture"),
    [(DENSE_GQA, "LlamaForCausalLM"), (TIED, "LlamaForCausalLM"), (MOE, "MixtralForCausalLM")],
    ids=["dense-gqa", "tied", "moe"],
)
def test_exported_model_gives_our_logits_under_transformers(
    tmp_path: Path, fields: dict[str, Any], architecture: str
) -> None:
    cfg = model_config(fields)
    train = train_config(tmp_path, cfg)
    ours = save_checkpoints(train, bytes_card(cfg), 5)
    result = export_checkpoint(train, out=tmp_path / "hf")
    assert result.architecture == architecture and result.step == 5
    assert result.n_params == ours.num_params()
    assert result.checkpoint_dir == str(tmp_path / "checkpoints" / step_dir_name(5))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["head_dim"] == cfg.head_dim
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": cfg.rope_theta}
    assert config["num_key_value_heads"] == cfg.kv_heads and config["max_position_embeddings"] == cfg.seq_len
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    diff = (hf_logits(tmp_path / "hf", ids) - our_logits(ours, ids)).abs().max().item()
    assert diff < 1e-5, diff


def test_a_sharded_export_gives_the_same_logits_and_an_index(tmp_path: Path) -> None:
    cfg = model_config(MOE)
    train = train_config(tmp_path, cfg)
    ours = save_checkpoints(train, bytes_card(cfg), 3)
    limit = 40_000  # the embedding (300 x 64 fp32 = 76.8 kB) exceeds it and gets a file of its own
    result = export_checkpoint(train, out=tmp_path / "hf", max_shard_bytes=limit)
    folder = tmp_path / "hf"
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 3 and not (folder / hf.WEIGHTS).exists()
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((folder / hf.WEIGHTS_INDEX).read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == ours.num_params() * 4
    from safetensors import safe_open

    for shard in shards:
        with safe_open(str(shard), "pt") as handle:
            sizes = [handle.get_slice(k).get_shape() for k in handle.keys()]  # noqa: SIM118 - safe_open has no iter
        nbytes = sum(4 * torch.Size(s).numel() for s in sizes)
        assert nbytes <= limit or len(sizes) == 1, (shard.name, nbytes)
    assert set(result.files) >= {p.name for p in shards} | {hf.WEIGHTS_INDEX, EXPORT_RECORD}
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(2))
    assert (hf_logits(folder, ids) - our_logits(ours, ids)).abs().max().item() < 1e-5


def test_our_names_map_to_the_llama_and_mixtral_names() -> None:
    assert hf_name("tok_emb.weight") == "model.embed_tokens.weight"
    assert hf_name("blocks.11.attn.wk.weight") == "model.layers.11.self_attn.k_proj.weight"
    assert hf_name("blocks.0.mlp.w1.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert hf_name("blocks.0.mlp.w3.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("blocks.2.mlp_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert hf_name("blocks.1.mlp.router.weight") == "model.layers.1.block_sparse_moe.gate.weight"
    assert hf_name("blocks.1.mlp.experts.7.w2.weight") == "model.layers.1.block_sparse_moe.experts.7.w2.weight"
    assert hf_name("lm_head.weight") == "lm_head.weight" and hf_name("lm_head.weight", tied=True) is None
    with pytest.raises(ExportError, match=r"tensor=blocks.0.attn.bias: is not a parameter"):
        hf_name("blocks.0.attn.bias")


def test_a_gelu_model_is_refused_with_the_reason_and_nothing_is_left(tmp_path: Path) -> None:
    cfg = model_config({**DENSE_GQA, "mlp": "gelu"})
    with pytest.raises(ExportError) as caught:
        hf_config(cfg)
    message = str(caught.value)
    assert message.startswith("model.mlp=gelu: the Llama and Mixtral MLP is SwiGLU") and "model.mlp: swiglu" in message
    train = train_config(tmp_path, cfg)
    save_checkpoints(train, bytes_card(cfg), 2)
    with pytest.raises(UserError, match="model.mlp=gelu"):
        export_checkpoint(train, out=tmp_path / "out" / "hf")
    assert not (tmp_path / "out").exists()


def test_dropout_exports_and_a_capacity_factor_is_noted(tmp_path: Path) -> None:
    cfg = model_config({**MOE, "dropout": 0.1})
    train = train_config(tmp_path, cfg, capacity_factor=1.25)
    ours = save_checkpoints(train, ModelCard.of_run(train, _bytes_manifest()), 4)
    result = export_checkpoint(train, out=tmp_path / "hf")
    assert len(result.notes) == 1 and "expert_capacity_factor=1.25" in result.notes[0]
    assert "dropless" in result.notes[0]
    record = json.loads((tmp_path / "hf" / EXPORT_RECORD).read_text())
    assert record["notes"] == result.notes and record["card"]["expert_capacity_factor"] == 1.25
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(3))
    assert (hf_logits(tmp_path / "hf", ids) - our_logits(ours, ids)).abs().max().item() < 1e-5  # ours: dropless


def _bytes_manifest() -> Any:
    from training.dataset import DatasetManifest, TokenizerInfo

    return DatasetManifest(vocab_size=257, dtype="uint16", eos_id=256, tokenizer=TokenizerInfo(kind="bytes"), splits={})


def test_the_bytes_tokenizer_round_trips_through_autotokenizer(tmp_path: Path) -> None:
    card = bytes_card(model_config(TIED))
    hf.write_tokenizer(card, StorageConfig(), tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = TextTokenizer("bytes")
    for text, ids in zip(TEXTS, ours.encode_batch(TEXTS), strict=True):
        assert loaded.encode(text) == ids.tolist() == list(text.encode("utf-8")), text
        assert loaded.decode(ids.tolist()) == text
    assert loaded.eos_token == hf.BYTE_EOS_TOKEN and loaded.eos_token_id == 256


def test_a_bpe_tokenizer_encodes_under_autotokenizer_as_ours(tmp_path: Path) -> None:
    corpus = [f"def function_{i}(value):\n    return value + {i}  # ünïcode {i % 7}\n" for i in range(300)]
    ours = train_bpe(corpus, TokenizerConfig(vocab_size=300, min_frequency=1))
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "tokenizer.json").write_text(ours.json_text)
    tokenizer = CardTokenizer(kind="bpe", url=str(dataset / "tokenizer.json"), sha256=ours.sha256)
    card = ModelCard(
        model=model_config(DENSE_GQA), vocab_size=300, eos_id=ours.eos_id, dataset_url=str(dataset), tokenizer=tokenizer
    )
    (tmp_path / "hf").mkdir()
    hf.write_tokenizer(card, StorageConfig(), tmp_path / "hf")
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    texts = [*TEXTS, corpus[3], "return value + 12345"]
    for text, ids in zip(texts, ours.encode_batch(texts), strict=True):
        assert loaded.encode(text) == ids.tolist(), text
    assert loaded.eos_token == "<|endoftext|>" and loaded.eos_token_id == ours.eos_id

    (dataset / "tokenizer.json").write_text(ours.json_text.replace('"<|endoftext|>"', '"<|end|>"'))
    with pytest.raises(ExportError, match=f"has sha256 .*, the checkpoint was trained with {ours.sha256}"):
        hf.write_tokenizer(card, StorageConfig(), tmp_path / "hf")


def test_a_run_on_adopted_ids_without_a_tokenizer_exports_only_with_one_given(tmp_path: Path) -> None:
    cfg = model_config(DENSE_GQA)  # vocab_size 300
    train = train_config(tmp_path, cfg)
    card = ModelCard(
        model=cfg, vocab_size=300, eos_id=None, dataset_url="/adopted", tokenizer=CardTokenizer(kind="unknown")
    )
    save_checkpoints(train, card, 3)
    with pytest.raises(ExportError, match=r"tokenizer\.kind=unknown: checkpoint step 3 was trained on adopted token "
                       r"ids \(/adopted\) and no tokenizer was named") as caught:  # fmt: skip
        export_checkpoint(train, out=tmp_path / "out" / "hf")
    assert "--tokenizer" in caught.value.fix and "data.tokenizer_url" in caught.value.fix
    assert not (tmp_path / "out").exists()  # refused before anything was written

    corpus = [f"row {i}: value + {i % 13} ünïcode" for i in range(200)]
    given = tmp_path / "given" / "tokenizer.json"
    given.parent.mkdir()
    for vocab, problem in ((320, r"the tokenizer has 320 tokens, more than the model's vocab_size=300"), (None, "")):
        ours = train_bpe(corpus, TokenizerConfig(vocab_size=vocab or 290, min_frequency=1))
        given.write_text(ours.json_text)
        if problem:
            with pytest.raises(ExportError, match=problem):
                export_checkpoint(train, out=tmp_path / "out" / "hf", tokenizer_url=str(given))
    result = export_checkpoint(train, out=tmp_path / "out" / "hf", tokenizer_url=str(given))
    assert (
        json.loads((tmp_path / "out" / "hf" / EXPORT_RECORD).read_text())["card"]["tokenizer"]["sha256"] == ours.sha256
    )
    loaded = transformers.AutoTokenizer.from_pretrained(result.model_dir)
    for text, ids in zip(corpus[:5], ours.encode_batch(corpus[:5]), strict=True):
        assert loaded.encode(text) == ids.tolist()

    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match=r"--tokenizer=.*bad\.json: not a tokenizers JSON file"):
        export_checkpoint(train, out=tmp_path / "other", tokenizer_url=str(tmp_path / "bad.json"))
    with pytest.raises(ExportError, match=r"--tokenizer=ftp://x/t\.json: .*scheme"):
        export_checkpoint(train, out=tmp_path / "other", tokenizer_url="ftp://x/t.json")
    bytes_train = train_config(tmp_path / "bytes", cfg)
    save_checkpoints(bytes_train, bytes_card(cfg), 2)
    with pytest.raises(ExportError, match=r"was trained with its dataset's own tokenizer \(bytes\)"):
        export_checkpoint(bytes_train, out=tmp_path / "other", tokenizer_url=str(given))


def test_each_checkpoint_holds_its_model_card_listed_in_the_commit(tmp_path: Path) -> None:
    cfg = model_config(TIED)
    train = train_config(tmp_path, cfg)
    card = bytes_card(cfg)
    save_checkpoints(train, card, 2, 4)
    manager = CheckpointManager(train.checkpoint, train.storage)
    for step in (2, 4):
        commit = manager.sound(step)
        assert commit is not None and MODEL_CARD in commit["files"]
        assert manager.read_card(step, commit) == card
    folder = tmp_path / "checkpoints" / step_dir_name(4)
    commit = json.loads((folder / COMMIT).read_text())
    del commit["files"][MODEL_CARD]  # as if the card had been put there after the commit
    (folder / COMMIT).write_text(json.dumps(commit))
    with pytest.raises(Exception, match=r"model.json is not listed in COMMIT.json, so nothing verifies it"):
        manager.read_card(4, commit)


def test_the_newest_sound_step_is_the_default_and_a_given_step_is_taken(tmp_path: Path) -> None:
    cfg = model_config(TIED)
    train = train_config(tmp_path, cfg)
    first = save_checkpoints(train, bytes_card(cfg), 2, seed=1)
    newest = save_checkpoints(train, bytes_card(cfg), 4, 6, seed=2)
    (tmp_path / "checkpoints" / step_dir_name(6) / COMMIT).unlink()  # 6 never committed: 4 is the newest sound one
    default = export_checkpoint(train, export_root=str(tmp_path / "export"))
    assert default.step == 4 and default.model_dir == str(tmp_path / "export" / "step-4")
    given = export_checkpoint(train, step=2, export_root=str(tmp_path / "export"))
    assert given.model_dir == str(tmp_path / "export" / "step-2")
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=torch.Generator().manual_seed(4))
    assert (hf_logits(given.model_dir, ids) - our_logits(first, ids)).abs().max().item() < 1e-5
    assert (hf_logits(default.model_dir, ids) - our_logits(newest, ids)).abs().max().item() < 1e-5
    assert (tmp_path / "export" / "step-4").exists() and not list((tmp_path / "export").glob(f"{PARTIAL_PREFIX}*"))


def test_a_missing_step_names_the_committed_ones_and_an_empty_folder_is_named(tmp_path: Path) -> None:
    cfg = model_config(TIED)
    train = train_config(tmp_path, cfg)
    with pytest.raises(UserError) as caught:
        export_checkpoint(train, out=tmp_path / "hf")
    assert f"checkpoint.url={tmp_path / 'checkpoints'}: no checkpoint there" in str(caught.value)
    assert "tdeploy train" in str(caught.value)
    save_checkpoints(train, bytes_card(cfg), 2, 4)
    with pytest.raises(UserError) as caught:
        export_checkpoint(train, step=3, out=tmp_path / "hf")
    assert str(caught.value).startswith(f"step=3: no checkpoint of that step under {tmp_path / 'checkpoints'}")
    assert "(committed steps: 2, 4)" in str(caught.value)
    shard = next((tmp_path / "checkpoints" / step_dir_name(4)).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"step=4: the checkpoint .* cannot be used: __0_0.distcp fails its sha256"):
        export_checkpoint(train, step=4, out=tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_failed_export_leaves_neither_a_folder_nor_a_partial_one(tmp_path: Path, monkeypatch) -> None:
    cfg = model_config(TIED)
    train = train_config(tmp_path, cfg)
    save_checkpoints(train, bytes_card(cfg), 2)

    def broken(*args: Any) -> list[str]:
        raise OSError("disk went away")

    monkeypatch.setattr("tasks.export.step.write_tokenizer", broken)
    with pytest.raises(OSError, match="disk went away"):
        export_checkpoint(train, out=tmp_path / "out" / "hf")
    assert list((tmp_path / "out").iterdir()) == []


def test_an_export_replaces_an_earlier_one_but_never_another_folder(tmp_path: Path) -> None:
    cfg = model_config(TIED)
    train = train_config(tmp_path, cfg)
    save_checkpoints(train, bytes_card(cfg), 2)
    first = export_checkpoint(train, out=tmp_path / "hf")
    second = export_checkpoint(train, out=tmp_path / "hf")
    assert second.files == first.files and (tmp_path / "hf" / EXPORT_RECORD).exists()
    record = json.loads((tmp_path / "hf" / EXPORT_RECORD).read_text())
    assert record["source"]["step"] == 2 and set(record["files"]) == set(first.files) - {EXPORT_RECORD}
    for name, entry in record["files"].items():
        assert (tmp_path / "hf" / name).stat().st_size == entry["bytes"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match=r"out=.*mine: exists and is not an export \(no EXPORT.json\)"):
        export_checkpoint(train, out=tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_checkpoint_without_a_card_exports_with_the_specs_model_and_says_so(tmp_path: Path, monkeypatch) -> None:
    cfg = model_config(DENSE_GQA)
    train = train_config(tmp_path, cfg)
    ours = save_checkpoints(train, None, 2)
    monkeypatch.setattr("tasks.export.step.read_manifest", lambda url, storage, trusted: _bytes_manifest())
    result = export_checkpoint(train, out=tmp_path / "hf")
    assert result.notes and "has no model.json" in result.notes[0]
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=torch.Generator().manual_seed(5))
    assert (hf_logits(tmp_path / "hf", ids) - our_logits(ours, ids)).abs().max().item() < 1e-5
    wider = train_config(tmp_path, model_config({**DENSE_GQA, "ffn_hidden": 128}))
    with pytest.raises(ExportError, match=r"checkpoint tensor blocks.0.mlp.w1.weight=\[96, 64\]: .* \[128, 64\]"):
        export_checkpoint(wider, out=tmp_path / "hf2")
