"""torch.distributed helpers: process group from torchrun, index-plan broadcast, rank slices, reductions.

The probe runs data-parallel when launched by `torchrun` (WORLD_SIZE > 1 in the environment):

- rank 0 draws the index plan and broadcasts it; each rank samples its slice of E and U, and the
  slices are all-gathered so that every rank holds the whole E and U in global order;
- the work of every phase (microbatches of prompts) is split into contiguous slices by `DistContext.
  work_slice`, aligned to the microbatches a single process would run, so that each microbatch is
  computed exactly as it would be in one process;
- LoRA-sized buffers are summed with one flat float64 all-reduce (`all_reduce_named`) and per-sequence
  values are gathered in global order (`gather_rows`, `sum_rows`), so that every statistic is then
  computed from the whole batch, identically on every rank.

The probe's backward passes are never wrapped in DDP: every reduction is explicit and happens here.
In one process (`SINGLE`, or no torchrun environment) every helper is a no-op returning its input.

A collective that fails or times out (a rank died or hangs) becomes one `DistributedError` line.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from ..errors import ProbeError

log = logging.getLogger("entropy_experiments.distributed")
T = TypeVar("T")


class DistributedError(ProbeError):
    """A collective failed or timed out: a rank died, hung or cannot be reached."""


@dataclass
class DistContext:
    """This process's place in the job. world_size == 1: every method is a no-op."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    timeout_s: float = 600.0
    owns_group: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        """Where tensors must sit for a collective (nccl: this rank's GPU; gloo: CPU)."""
        if self.backend == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    # ------------------------------------------------------------------ slices
    def work_slice(self, n_items: int) -> range:
        """The contiguous range of `n_items` work items (microbatches, chunks) this rank runs.

        numpy.array_split semantics: the first ranks get one more item when it does not divide, so
        rank 0 always runs item 0 (the first microbatch) when there is one.
        """
        return rank_range(n_items, self.rank, self.world_size)

    def chunk_slice(self, chunks: Sequence[T]) -> list[T]:
        """This rank's contiguous share of an ordered list of work items."""
        r = self.work_slice(len(chunks))
        return list(chunks[r.start:r.stop])

    def prompt_slice(self, n_prompts: int, chunk: int = 1) -> list[int]:
        """This rank's prompts: whole chunks of `chunk` consecutive prompts, split contiguously."""
        chunks = [list(range(i, min(i + chunk, n_prompts))) for i in range(0, n_prompts, max(1, chunk))]
        return [p for c in self.chunk_slice(chunks) for p in c]

    def scoring_prompts(self, num_prompts: int, G: int, tf_batch_size: int) -> list[int]:
        """This rank's prompts for no-grad scoring: whole teacher-forcing chunks of `tf_batch_size` sequences."""
        return self.prompt_slice(num_prompts, max(1, int(tf_batch_size) // G))

    def row_gatherer(self, rows_mine: Sequence[int], n_rows: int) -> Callable[[Sequence[float], str], np.ndarray]:
        """gather(values of this rank's rows, what) → float64 [n_rows] in global order, on every rank."""
        def gather(values_mine: Sequence[float], what: str) -> np.ndarray:
            if not self.enabled:
                return np.asarray(values_mine, dtype=np.float64)
            full = np.zeros(n_rows, dtype=np.float64)
            full[list(rows_mine)] = values_mine
            return self.sum_rows(full, what)
        return gather

    # ------------------------------------------------------------------ collectives
    def _collective(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except DistributedError:
            raise
        except (RuntimeError, ValueError, OSError) as exc:
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise DistributedError(
                f"distributed: rank {self.rank}/{self.world_size} lost its peers in '{what}' — another rank died "
                f"or did not answer within the collective timeout (distributed.timeout_s={self.timeout_s:g} s); "
                f"cause: {first}") from None

    def broadcast_object(self, obj: T, what: str, src: int = 0) -> T:
        """rank `src`'s `obj` on every rank (pickled)."""
        if not self.enabled:
            return obj
        import torch.distributed as dist
        box = [obj if self.rank == src else None]
        self._collective(what, lambda: dist.broadcast_object_list(box, src=src, device=self._object_device()))
        return box[0]

    def all_gather_object(self, obj: Any, what: str) -> list:
        """[obj of rank 0, obj of rank 1, …] on every rank."""
        if not self.enabled:
            return [obj]
        import torch.distributed as dist
        out: list = [None] * self.world_size
        self._collective(what, lambda: dist.all_gather_object(out, obj))
        return out

    def all_reduce_tensor(self, t: Tensor, what: str) -> Tensor:
        """Σ over ranks of `t` (same shape on every rank); a new tensor on t's device and dtype."""
        if not self.enabled:
            return t
        import torch.distributed as dist
        buf = t.detach().to(self.comm_device).clone()
        self._collective(what, lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM))
        return buf.to(device=t.device, dtype=t.dtype)

    def all_reduce_named(self, named: dict[str, Tensor], what: str) -> dict[str, Tensor]:
        """Σ over ranks of every tensor of `named`, in ONE flat float64 all-reduce (dtype kept)."""
        if not self.enabled:
            return named
        names = list(named)
        flat = torch.cat([named[n].detach().to(self.comm_device, torch.float64).reshape(-1) for n in names])
        flat = self.all_reduce_tensor(flat, what)
        out, offset = {}, 0
        for n in names:
            ref = named[n]
            out[n] = flat[offset:offset + ref.numel()].reshape(ref.shape).to(device=ref.device, dtype=ref.dtype)
            offset += ref.numel()
        return out

    def all_reduce_tree(self, tree: dict[str, Any], what: str) -> dict[str, Any]:
        """Σ over ranks of every tensor and float in a nested dict / list, in ONE flat float64 all-reduce
        (structure and dtypes kept; floats come back as floats)."""
        if not self.enabled:
            return tree
        flat: dict[str, Tensor] = {}

        def put(key: str, node: Any) -> None:
            if isinstance(node, (dict, list)):
                for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
                    put(f"{key}/{k}", v)
            else:
                flat[key] = node if isinstance(node, Tensor) else torch.tensor([float(node)], dtype=torch.float64)

        def get(key: str, node: Any) -> Any:
            if isinstance(node, dict):
                return {k: get(f"{key}/{k}", v) for k, v in node.items()}
            if isinstance(node, list):
                return [get(f"{key}/{i}", v) for i, v in enumerate(node)]
            return summed[key] if isinstance(node, Tensor) else float(summed[key][0])

        put("", tree)
        summed = self.all_reduce_named(flat, what)
        return get("", tree)

    def broadcast_float(self, value: float | None, what: str) -> float | None:
        """rank 0's float (or None) on every rank."""
        return self.broadcast_object(value, what)

    def max_float(self, value: float | None, what: str) -> float | None:
        """The largest of the ranks' floats (None where a rank has none; None when no rank has one)."""
        values = [v for v in self.all_gather_object(value, what) if v is not None]
        return max(values, default=None)

    def gather_rows(self, local: dict[int, Any], n_rows: int, what: str) -> list:
        """Merge {global index: value} from every rank into one list [n_rows] in global order.

        Every index must be provided by exactly one rank (no gaps, no duplicates)."""
        parts = self.all_gather_object(local, what) if self.enabled else [local]
        out: list = [None] * n_rows
        seen = 0
        for part in parts:
            for i, value in part.items():
                if out[i] is not None:
                    raise RuntimeError(f"{what}: row {i} provided by two ranks")
                out[i] = value
                seen += 1
        if seen != n_rows:
            raise RuntimeError(f"{what}: {n_rows - seen} of {n_rows} rows provided by no rank")
        return out

    def sum_rows(self, values: np.ndarray | Tensor, what: str) -> np.ndarray:
        """Element-wise Σ over ranks of a float64 [N] array that is zero outside this rank's rows
        (exact: every element is non-zero on one rank at most)."""
        t = torch.as_tensor(np.asarray(values, dtype=np.float64))
        return self.all_reduce_tensor(t, what).numpy() if self.enabled else t.numpy()

    def _object_device(self):
        return self.comm_device if self.backend == "nccl" else None

    # ------------------------------------------------------------------ life cycle
    def shutdown(self) -> None:
        if self.owns_group:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
            self.owns_group = False


SINGLE = DistContext()


def rank_range(n_items: int, rank: int, world_size: int) -> range:
    """Contiguous numpy.array_split share of range(n_items) for `rank` (first ranks get the extra item)."""
    base, extra = divmod(n_items, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def launched_world_size() -> int:
    """WORLD_SIZE set by torchrun (1 when not launched by it)."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        world = 0
    if world < 1:
        raise DistributedError(f"distributed: WORLD_SIZE must be a positive integer, got {raw!r}")
    return world


def init_from_env(settings: Any = None) -> DistContext:
    """The DistContext of this process: from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT), creating the process group if needed; SINGLE when not launched with several ranks.

    `settings`: the config's `distributed` section (backend auto | nccl | gloo, timeout_s).
    """
    import torch.distributed as dist

    backend_cfg = getattr(settings, "backend", "auto") if settings is not None else "auto"
    timeout_s = float(getattr(settings, "timeout_s", 600.0) if settings is not None else 600.0)
    if dist.is_available() and dist.is_initialized():  # someone (a test, a wrapper) made the group already
        ws = dist.get_world_size()
        if ws == 1:
            return DistContext(timeout_s=timeout_s)
        return DistContext(rank=dist.get_rank(), world_size=ws, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                           backend=dist.get_backend(), timeout_s=timeout_s, owns_group=False)
    world = launched_world_size()
    if world <= 1:
        return DistContext(timeout_s=timeout_s)
    if not dist.is_available():
        raise DistributedError("distributed: WORLD_SIZE > 1 but this torch build has no torch.distributed")
    backend = resolve_backend(backend_cfg)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise DistributedError("distributed.backend: nccl needs CUDA, and none is available (use gloo or auto)")
        if local_rank >= torch.cuda.device_count():
            raise DistributedError(f"distributed: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} "
                                   "CUDA devices on this node (lower --nproc_per_node)")
        torch.cuda.set_device(local_rank)
    ctx = DistContext(rank=rank, world_size=world, local_rank=local_rank, backend=backend, timeout_s=timeout_s,
                      owns_group=True)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", local_rank)
    ctx._collective("init_process_group", lambda: dist.init_process_group(**kwargs))
    log.info("distributed: rank %d of %d (local rank %d), backend %s, timeout %g s", rank, world, local_rank,
             backend, timeout_s)
    return ctx


def rank_seed(seed: int, rank: int) -> int:
    """The generator seed of `rank` for a sampling stream whose single-process seed is `seed`
    (rank 0 keeps `seed`, so a one-process run is unchanged)."""
    return int(seed) + 1_000_003 * int(rank)
