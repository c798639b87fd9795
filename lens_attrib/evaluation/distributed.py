"""torchrun / accelerate integration: ranks, devices, and the gather of records to rank 0.

``torchrun --nproc-per-node N -m lens_attrib.evaluation.runner ...`` (and ``accelerate
launch``) start N processes with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and a rendezvous
address in the environment. :func:`init_from_env` joins the process group (NCCL when CUDA is
available, else gloo) and gives the rank's device (``cuda:LOCAL_RANK`` or the CPU); the runner
then takes shard ``(RANK, WORLD_SIZE)`` of its deterministic batch plan, and rank 0 receives
every rank's records through :func:`gather_to_rank0` after a barrier. Without these variables
(or with ``WORLD_SIZE=1``) everything runs in one process and nothing is initialised.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Rank:
    """This process's place in the run."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def shard(self) -> tuple[int, int]:
        return self.rank, self.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """Whether the environment names more than one process (torchrun, accelerate, Slurm+srun)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env() -> Rank | None:
    """Join the process group described by the environment; ``None`` for a single process."""
    if not launched_by_torchrun():
        return None
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    return Rank(rank, world, local, device)


def current() -> Rank | None:
    """The rank of an already initialised process group (``None`` when there is none)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    return Rank(dist.get_rank(), dist.get_world_size(), local, device)


def gather_to_rank0(payload: Any) -> list[Any] | None:
    """Every rank's ``payload`` in rank order on rank 0 (``None`` elsewhere), after a barrier."""
    dist.barrier()
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    return gathered


def finish() -> None:
    """Wait for every rank, then leave the process group."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


__all__ = ["Rank", "current", "finish", "gather_to_rank0", "init_from_env", "launched_by_torchrun"]
