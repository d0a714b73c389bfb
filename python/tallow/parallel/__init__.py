"""Tensor parallelism: the collectives the sharded layers call and the worker processes of ranks > 0.

    communicator.py      the Communicator interface (all_reduce in place, all_gather, broadcast) and the
                         process-wide tensor-parallel group the layers read (get_tp_group)
    shm_communicator.py  the CPU implementation over multiprocessing.shared_memory (numpy, f32 sums,
                         the same reduction order on every rank: bit-identical results everywhere)
    workers.py           rank > 0 as spawned processes: their loop, their start-up, their shutdown

Where NCCL plugs in: tallow._core has no NCCL bindings yet. An `NcclCommunicator(Communicator)` wraps
the C++ collectives (bound through pybind11, run on the runner's stream, so the decode CUDA graphs
capture them); the executor builds it instead of ShmCommunicator when the device is a GPU (each rank
needs the NCCL unique id, sent to the workers with their start-up arguments). Nothing in the layers or
the runner changes: they only call the group's methods.
"""
from tallow.parallel.communicator import Communicator, CollectiveError, get_tp_group, set_tp_group

__all__ = ["Communicator", "CollectiveError", "get_tp_group", "set_tp_group"]
