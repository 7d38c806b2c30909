"""Serving on Kubernetes: the CPU image on CPU specs, requests and limits from the serving plan, the namespace."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tasks.capacity.catalogue import resolve_accelerator
from tasks.capacity.params import Architecture
from tasks.capacity.plan import serving_plan
from tasks.capacity.serving import POD_PROCESS_GIB
from tasks.serve.config import CPU_IMAGE, ServeConfig
from tasks.serve.manifests import MEMORY_HEADROOM, PodResources, render_kubernetes, validate_kubernetes
from training.config import PrecisionConfig

ARCH = Architecture(n_layers=2, d_model=128, n_heads=4, ffn_hidden=256, vocab_size=1000, seq_len=256)


def _container(objects: list[dict]) -> dict:
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def _rendered(serve: ServeConfig, accelerator: str) -> dict:
    """The server container with its resources from the serving plan of ARCH."""
    acc = resolve_accelerator(accelerator)
    plan = serving_plan(ARCH, acc, serve, PrecisionConfig())
    resources = PodResources.of(serve, plan.pod_memory_bytes(acc))
    objects = render_kubernetes(serve, "llm", "pvc://models", accelerator=accelerator, resources=resources)
    validate_kubernetes(objects)
    return _container(objects)


def _mib(quantity: str) -> int:
    assert quantity.endswith("Mi")
    return int(quantity[:-2])


def test_a_cpu_spec_runs_vllms_cpu_image_and_a_gpu_spec_the_cuda_one() -> None:
    serve = ServeConfig()
    assert _rendered(serve, "cpu")["image"] == CPU_IMAGE == "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"
    assert _rendered(serve, "h100-sxm")["image"] == serve.image
    own = ServeConfig(cpu_image="registry.example.com/vllm-cpu:1")
    assert _rendered(own, "cpu")["image"] == "registry.example.com/vllm-cpu:1"
    explicit = render_kubernetes(serve, "llm", "pvc://m", "registry.example.com/mine:2", accelerator="cpu")
    assert _container(explicit)["image"] == "registry.example.com/mine:2"


def test_cpu_pods_request_what_they_are_limited_to_and_memory_grows_with_the_kv_cache_space() -> None:
    small, large = (_rendered(ServeConfig(kv_cache_gib=gib, cpu_per_replica=6), "cpu") for gib in (2, 6))
    for container in (small, large):
        assert container["resources"]["requests"] == container["resources"]["limits"]  # Guaranteed QoS
        assert container["resources"]["requests"]["cpu"] == "6000m"
        assert "nvidia.com/gpu" not in container["resources"]["requests"]
    # VLLM_CPU_KVCACHE_SPACE is allocated whole: 4 GiB more of it is 4 GiB x headroom more memory (MiB rounding)
    grown = _mib(large["resources"]["requests"]["memory"]) - _mib(small["resources"]["requests"]["memory"])
    assert abs(grown - 4 * 1024 * MEMORY_HEADROOM) <= 1
    assert _mib(small["resources"]["requests"]["memory"]) >= 2 * 1024 * MEMORY_HEADROOM


def test_gpu_pods_request_the_host_memory_of_their_ranks_and_their_gpus() -> None:
    one, two = (_rendered(ServeConfig(tensor_parallel=tp), "h100-sxm") for tp in (1, 2))
    assert one["resources"]["limits"]["nvidia.com/gpu"] == "1" and two["resources"]["limits"]["nvidia.com/gpu"] == "2"
    # one more rank: one more server process (POD_PROCESS_GIB) with headroom; ARCH's weights are a few MiB
    grown = _mib(two["resources"]["requests"]["memory"]) - _mib(one["resources"]["requests"]["memory"])
    assert abs(grown - POD_PROCESS_GIB * 1024 * MEMORY_HEADROOM) <= 8


def test_the_spec_memory_per_replica_overrides_the_plan() -> None:
    container = _rendered(ServeConfig(memory_per_replica_gb=10), "cpu")
    assert container["resources"]["limits"]["memory"] == "10240Mi"  # GiB, as cluster.kubernetes.memory_per_node_gb


def test_without_a_plan_or_a_memory_field_a_pod_still_requests_its_cpu() -> None:
    container = _container(render_kubernetes(ServeConfig(cpu_per_replica=0.5), "llm", "pvc://m", accelerator="cpu"))
    assert container["resources"] == {"limits": {"cpu": "500m"}, "requests": {"cpu": "500m"}}


def test_the_deployment_and_service_land_in_the_serve_namespace() -> None:
    objects = render_kubernetes(ServeConfig(namespace="serving"), "llm", "pvc://m", accelerator="cpu")
    validate_kubernetes(objects)
    assert [o["metadata"]["namespace"] for o in objects] == ["serving", "serving"]
    with pytest.raises(ValidationError, match="'Serving_NS' is not a Kubernetes namespace"):
        ServeConfig(namespace="Serving_NS")
