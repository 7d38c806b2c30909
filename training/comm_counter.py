"""Communication of one training step per mesh dimension: bytes each rank sends, and seconds.

A TorchDispatchMode (the mechanism of torch's CommDebugMode, which counts calls but not bytes or groups) sees every
c10d and functional collective the step issues: DTensor's (tensor and sequence parallel, loss_parallel), FSDP2's
all-gathers and reduce-scatters, the expert all-to-alls and the pipeline's sends. Each call is booked to the mesh
dimension of its process group and converted to the bytes one rank sends under the ring algorithms, the
convention of the planner's model (tasks/capacity/comm.py): an all-reduce of B bytes sends 2(n-1)/n B, an
all-gather (n-1)/n of its output, a reduce-scatter (n-1)/n of its input, an all-to-all what leaves the rank, a
send its tensor. gloo's own algorithms may move other amounts.

With `timed`, each collective is waited for where it is issued and the seconds booked to its dimension: the
step's communication is serialised, so the trainer times one step per launch this way (the measurement step of
training/train.py), not every step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from training.layout import MESH_GROUPS

DIMS = tuple(MESH_GROUPS)
"""The sub-groups traffic is booked to: the mesh's (training/layout.py MESH_GROUPS), context parallel included."""
PLANNER_KEYS = {
    "tp": "tensor_parallel",
    "cp": "context_parallel",
    "pp": "pipeline_parallel",
    "dp": "data_parallel",
    "ep": "expert_parallel",
}
"""Each sub-group's `parallel` degree, the key of its bytes per step in the planner's model (tasks/capacity/comm.py)."""
_MESH_DIM_LABELS = {dim: group for group, dims in MESH_GROUPS.items() for dim in dims} | {"dp": "dp", "dp_mod_ep": "dp"}
"""Each mesh dimension's sub-group label (the expert mesh's dp_mod_ep and the flattened dp count as data parallel)."""
_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def _group_of(args: tuple[Any, ...]) -> dist.ProcessGroup | None:
    """The process group of a c10d op (a boxed ScriptObject) or a functional one (its group name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg)
            except RuntimeError:  # a ReduceOp, not a group
                continue
    names = [a for a in args if isinstance(a, str)]
    return _resolve_process_group(names[-1]) if names else None


def ring_bytes(op: str, args: tuple[Any, ...], group_size: int, group_rank: int) -> tuple[float, float]:
    """(bytes this rank sends under the ring algorithms, bytes of the buffer it passed) of one collective."""
    n = group_size
    share = (n - 1) / n if n > 1 else 0.0
    if op in ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_coalesced"):
        buf = _nbytes(args[0])
        return 2 * share * buf, buf
    if op in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_", "allgather_coalesced_"):
        buf = _nbytes(args[0])  # the gathered output
        return share * buf, buf
    if op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        buf = _nbytes(args[0]) * n
        return share * buf, buf
    if op in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        buf = _nbytes(args[1])  # the input that is reduced
        return share * buf, buf
    if op in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        buf = _nbytes(args[0])
        return share * buf, buf
    if op in ("alltoall_base_", "all_to_all_single"):
        # c10d: (output, input, group, output_splits, input_splits); functional: (input, output_splits, input_splits)
        inp, splits = (args[1], args[4]) if op == "alltoall_base_" else (args[0], args[2])
        buf = _nbytes(inp)
        if not splits:
            return share * buf, buf
        row = buf / max(1, sum(splits))
        return row * (sum(splits) - splits[group_rank]), buf
    if op == "alltoall_":
        buf = _nbytes(args[1])
        return share * buf, buf
    if op in ("send", "broadcast_", "broadcast"):
        buf = _nbytes(args[0])
        return float(buf), buf
    return 0.0, 0.0  # recv, barrier, wait_tensor, ...: nothing sent


def _label(dims: tuple[str, ...], op: str) -> str:
    """The dimension a collective serves when its group serves several (a mesh dimension spanning the same ranks
    as another reuses its group, e.g. ep and dp on two processes): all-to-alls are expert dispatch."""
    if len(dims) == 1:
        return dims[0]
    if "ep" in dims and op in ("alltoall_base_", "alltoall_", "all_to_all_single"):
        return "ep"
    return next(d for d in ("dp", "tp", "pp", "cp", *dims) if d in dims)


# Waiting for a send where it is issued can deadlock a pipeline schedule (its peer may post the matching receive
# only after its own send): point-to-point bytes are counted, their time is not.
_POINT_TO_POINT = {"send", "recv", "recv_", "recv_any_source_", "batch_isend_irecv"}


def _wait(out: Any) -> None:
    """Wait for a collective's result where it was issued: a c10d op's Work, a functional op's tensor."""
    items = out if isinstance(out, list | tuple) else (out,)
    for item in items:
        if isinstance(item, torch.ScriptObject) and hasattr(item, "wait"):
            item.wait()
        elif isinstance(item, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(item)
        elif isinstance(item, list | tuple):
            _wait(item)


@dataclass
class TrafficCounter(TorchDispatchMode):
    """Bytes sent per mesh dimension (see the module docstring) while active; `labels` maps group names."""

    labels: dict[str, tuple[str, ...]] = field(default_factory=dict)
    timed: bool = False
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    sent: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    buffers: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        if any(issubclass(t, DTensor) for t in types):
            # A mode runs before subclasses: let DTensor run the op, so that the collectives it desugars into (the
            # redistributions sharding propagation asks for, loss_parallel's) come back here on plain tensors.
            return NotImplemented
        started = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", None) in _NAMESPACES:
            op = func._overloadpacket.__name__  # noqa: SLF001 - the op's name
            group = _group_of(tuple(args))
            if group is not None and op not in ("wait_tensor", "_wrap_tensor_autograd", "recv_", "recv"):
                label = _label(self.labels.get(group.group_name, ("other",)), op)
                rank = group.rank()
                sent, buf = ring_bytes(op, tuple(args), group.size(), rank)
                self.sent[label] += sent
                self.buffers[label] += buf
                self.calls[label] += 1
                self.ops[f"{label}:{op}"] += 1
                if self.timed and op not in _POINT_TO_POINT:  # a send completes only once its peer receives
                    _wait(out)
                    self.seconds[label] += time.perf_counter() - started
        return out

    def reset(self) -> None:
        """Forget what was counted."""
        for table in (self.sent, self.buffers, self.calls, self.ops, self.seconds):
            table.clear()


def group_labels(meshes: Any) -> dict[str, tuple[str, ...]]:
    """Group name -> the dimensions (dp, tp, pp, ep, cp) it serves, for every dimension of the trainer's meshes
    (None: pure data parallel, where every group is the data-parallel one)."""
    if meshes is None:
        return {dist.group.WORLD.group_name: ("dp",)}
    labels: dict[str, set[str]] = defaultdict(set)
    for mesh in (meshes.world, meshes.experts):
        if mesh is None:
            continue
        for name in mesh.mesh_dim_names:
            if mesh.size(mesh.mesh_dim_names.index(name)) > 1:
                labels[mesh.get_group(name).group_name].add(_MESH_DIM_LABELS[name])
    if meshes.dims.dp > 1:
        labels[meshes.dp_flat.get_group().group_name].add("dp")
    return {name: tuple(sorted(dims)) for name, dims in labels.items()}
