"""The `serve` section of the spec: how the exported model is served (vLLM's OpenAI-compatible server)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from tasks.image.config import image_reference
from tasks.launch.config import KubernetesNamespace
from tasks.serve.check import ServingCheckConfig
from tasks.serve.classifier_config import ClassifierServeConfig, classifier_unservable
from training.config import ModelConfig, StrictModel

CPU_IMAGE = "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"
"""vLLM's x86 CPU release image (vLLM's docs: Installation, CPU, pre-built images), the version of `image`'s default."""


# vLLM's CPU attention kernels take these head sizes only ("Unsupported CPU attention configuration: head_dim=16").
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 192, 256)


class ServeConfig(StrictModel):
    """The serving engine and its limits (`tdeploy serve`, the pipeline's serving check)."""

    engine: Literal["vllm"] = Field(default="vllm", description="Serving engine: vLLM's OpenAI-compatible server.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None,
        description="Weights and activations dtype of the served model; None = the model folder's own (config.json "
        "torch_dtype, which the export sets to the dtype the run trained in). vLLM's own default would downcast a "
        "float32 model to bfloat16.",
    )
    max_model_len: int | None = Field(
        default=None, ge=2, le=1_048_576, description="Longest prompt + completion in tokens; None = model.seq_len."
    )
    max_num_seqs: int = Field(
        default=16, ge=1, le=4096, description="Most sequences the engine batches at once (continuous batching)."
    )
    kv_cache_gib: float = Field(
        default=1.0, gt=0, le=4096, description="Memory for the paged KV cache in GiB (VLLM_CPU_KVCACHE_SPACE on CPU)."
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="Share of each GPU's memory vLLM may take (GPU serving only)."
    )
    host: Literal["127.0.0.1", "0.0.0.0"] = Field(  # noqa: S104 - a server that a cluster Service reaches
        default="127.0.0.1", description="Address the server listens on: loopback, or all interfaces."
    )
    port: int = Field(default=8000, ge=1024, le=65535, description="Port of the OpenAI-compatible HTTP API.")
    tensor_parallel: int = Field(default=1, ge=1, le=64, description="GPUs one server shards the model over.")
    startup_timeout_s: float = Field(
        default=900.0, gt=0, le=7200, description="How long the server may take to answer /health after start."
    )
    image: str = Field(
        default="docker.io/vllm/vllm-openai:v0.32.0",
        min_length=1,
        description="Image of vLLM's OpenAI-compatible server that the Kubernetes manifest runs; its vLLM version "
        "decides the server's flags and metric names. Pin it by digest (name@sha256:...) for deploys that stay "
        "identical when the tag moves.",
    )
    cpu_image: str = Field(
        default=CPU_IMAGE,
        min_length=1,
        description="Image of vLLM's OpenAI-compatible server built for CPUs (vLLM's x86 CPU release image) that "
        "the Kubernetes manifest runs when cluster.accelerator is cpu; keep its version equal to `image`'s.",
    )
    replicas: int = Field(
        default=1, ge=1, le=1000, description="Servers the Kubernetes Deployment runs behind its one Service."
    )
    namespace: KubernetesNamespace = Field(
        default="default",
        description="Kubernetes namespace of the serving Deployment and Service (its own: serving often lives apart "
        "from training's cluster.kubernetes.namespace).",
    )
    cpu_per_replica: float = Field(
        default=4.0,
        gt=0,
        le=1024,
        allow_inf_nan=False,
        description="CPU cores each server pod requests and is limited to (requests = limits: Guaranteed QoS); on "
        "CPU serving vLLM's threads run on them.",
    )
    memory_per_replica_gb: float | None = Field(
        default=None,
        gt=0,
        le=100_000,
        allow_inf_nan=False,
        description="Memory each server pod requests and is limited to, in GB (GiB, as cluster.kubernetes."
        "memory_per_node_gb); None = the serving plan's estimate "
        "(tasks/capacity: weights, activations, overhead and KV cache on CPU; the weights' host copy plus the "
        "process on GPUs), with 20% headroom.",
    )
    model_impl: Literal["auto", "vllm", "transformers"] = Field(
        default="auto",
        description="vLLM's model implementation (--model-impl): vllm its own, transformers the Hugging Face "
        "model code run by vLLM's transformers backend. auto: transformers for a vision-language (LLaVA) export "
        "on CPU, where vLLM-CPU 0.32's own LLaVA does not load (it imports torchvision, which does not load beside "
        "the CPU torch), and vLLM's own choice otherwise.",
    )
    images_per_prompt: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Most images one request may carry (--limit-mm-per-prompt), for a vision-language model; the "
        "captioning check sends one.",
    )
    check: ServingCheckConfig = Field(
        default_factory=ServingCheckConfig,
        description="The pipeline's serving check: load test, greedy parity, quality probes and thresholds.",
    )
    classifier: ClassifierServeConfig = Field(
        default_factory=ClassifierServeConfig,
        description="model.kind vit: the image classifier's server (transformers behind HTTP with dynamic "
        "batching; vLLM serves no image classification) and its serving check.",
    )

    @field_validator("image", "cpu_image")
    @classmethod
    def _image_reference(cls, value: str) -> str:
        return image_reference(value, "docker.io/vllm/vllm-openai:v0.32.0")


def serving_image(serve: ServeConfig, accelerator: str) -> str:
    """The server's image on `accelerator`: serve.cpu_image on CPUs, serve.image (CUDA) on GPUs."""
    return serve.cpu_image if accelerator == "cpu" else serve.image


def unservable(model: ModelConfig, serve: ServeConfig, accelerator: str) -> list[str]:
    """Why `model` cannot be served as configured (empty when it can), each with the fix."""
    if model.kind == "vit":  # served by transformers (tasks/serve/classifier.py), not vLLM
        return classifier_unservable(serve.classifier, serve.tensor_parallel)
    problems = []
    if accelerator == "cpu" and model.head_dim not in CPU_HEAD_DIMS:
        good = [h for h in CPU_HEAD_DIMS if model.d_model % h == 0 and model.d_model // h >= 1]
        fix = (
            f"set model.n_heads to {', '.join(str(model.d_model // h) for h in good)} (head_dim {good})"
            if good
            else f"make d_model a multiple of one of {list(CPU_HEAD_DIMS)}"
        )
        problems.append(
            f"model.head_dim={model.head_dim} (d_model={model.d_model} / n_heads={model.n_heads}): vLLM's CPU "
            f"attention supports head_dim {list(CPU_HEAD_DIMS)} only; {fix}"
        )
    if serve.max_model_len is not None and serve.max_model_len > model.seq_len:
        problems.append(
            f"serve.max_model_len={serve.max_model_len}: longer than the trained model.seq_len={model.seq_len} "
            f"(RoPE positions beyond it were never trained); use at most {model.seq_len} or leave it unset"
        )
    if model.n_heads % serve.tensor_parallel or model.kv_heads % serve.tensor_parallel:
        problems.append(
            f"serve.tensor_parallel={serve.tensor_parallel}: must divide n_heads={model.n_heads} and "
            f"n_kv_heads={model.kv_heads}; use 1 or a common divisor"
        )
    if accelerator == "cpu" and serve.tensor_parallel > 1:
        problems.append(f"serve.tensor_parallel={serve.tensor_parallel}: CPU serving runs one process; use 1")
    return problems
