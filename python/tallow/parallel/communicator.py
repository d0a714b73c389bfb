"""The collectives interface of tensor parallelism and the process-wide group the layers use.

A process holds at most one tensor-parallel group (one model per rank). The layers call the group only
when their tp_size > 1, so a tp=1 model never touches it, and a process may build tp=1 and tp>1
engines one after the other (tests do)."""
from __future__ import annotations

import abc
from typing import Optional

import tallow


class CollectiveError(RuntimeError):
    """A collective could not complete: a peer died, failed, or did not arrive within the timeout."""


class Communicator(abc.ABC):
    """Collectives over `world_size` ranks. Every rank calls the same collectives in the same order
    with tensors of the same shape and dtype (the ranks run the same model on the same step)."""

    rank: int
    world_size: int

    @abc.abstractmethod
    def all_reduce(self, t: tallow.Tensor) -> tallow.Tensor:
        """Sum `t` over the ranks, in place; returns `t`. Every rank gets bit-identical values."""

    @abc.abstractmethod
    def all_gather(self, t: tallow.Tensor, dim: int = -1) -> tallow.Tensor:
        """A new tensor: the ranks' `t` concatenated along `dim` in rank order."""

    @abc.abstractmethod
    def broadcast(self, t: tallow.Tensor, src: int = 0) -> tallow.Tensor:
        """Rank `src`'s `t` copied into `t` on every rank, in place; returns `t`."""

    @abc.abstractmethod
    def abort(self, reason: str = "") -> None:
        """Make every rank's pending and later collectives raise CollectiveError (a rank failed)."""

    def close(self) -> None:
        """Release this rank's resources (the creator also removes shared ones)."""


_group: Optional[Communicator] = None


def set_tp_group(comm: Optional[Communicator]) -> None:
    global _group
    _group = comm


def clear_tp_group(comm: Communicator) -> None:
    """Forget `comm` if it is the process's group (its engine shut down)."""
    global _group
    if _group is comm:
        _group = None


def get_tp_group() -> Communicator:
    if _group is None:
        raise CollectiveError("a tensor-parallel layer ran without a tensor-parallel group (build the model "
                              "through the executor, which starts the ranks and their communicator)")
    return _group


def wait_event(event) -> None:
    """Wait for a step's event (recorded after its collectives): through the group where it has its own
    wait (NCCL: a dead or stuck peer raises CollectiveError instead of hanging), else in the driver."""
    wait = getattr(_group, "wait", None)
    if wait is None:
        event.synchronize()
    else:
        wait(event)
