"""Data-parallel evaluation over the processes of one host, started by torchrun (``accelerate
launch`` starts its processes the same way).

torchrun gives each process RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
:func:`process_group` joins them into one torch.distributed group from those variables
(``env://``): nccl when the model runs on CUDA, each rank on ``cuda:LOCAL_RANK``, gloo on the
CPU. Without them every function here is the single-process identity.

Who shards what: lm-eval's evaluator deals each task's documents round-robin by the adapter's
``rank`` and ``world_size`` and gathers through its ``all_gather``, ``gather_object`` and
``barrier`` (:class:`quamba.eval.lm.QuambaLM`, as lm-eval's HFLM); perplexity deals its batches
of windows (:mod:`quamba.eval.perplexity`). Rank 0 alone writes the run record.
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from quamba.cli_support import default_device
from quamba.errors import QuambaError

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# As lm-eval's HFLM (InitProcessGroupKwargs(timeout=timedelta(weeks=52))): the other ranks wait
# as long as rank 0 calibrates; a rank that fails ends the others through torchrun, which stops
# every worker when one exits with an error.
TIMEOUT = timedelta(weeks=52)


def launched() -> bool:
    """Whether a launcher (torchrun) started this process as one rank of several."""
    return all(name in os.environ for name in LAUNCHER_VARIABLES)


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def local_device(device: str | None) -> str | None:
    """This rank's device: under a launcher, CUDA means ``cuda:LOCAL_RANK``; else ``device``."""
    if not launched():
        return device
    parsed = torch.device(device or default_device())
    if parsed.type != "cuda":
        return str(parsed)
    if parsed.index is not None and int(os.environ["WORLD_SIZE"]) > 1:
        raise QuambaError(f"--device {device}: each rank of a data-parallel run takes the GPU of "
                          "its LOCAL_RANK; give --device cuda (or no --device)")
    return f"cuda:{os.environ['LOCAL_RANK']}"


@contextlib.contextmanager
def process_group(device: str | None):
    """The process group of a launched run on ``device`` (:func:`local_device`), torn down on
    the way out, error or not; the other ranks than 0 log errors only. A no-op unlaunched."""
    if not launched():
        yield
        return
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method="env://", timeout=TIMEOUT,
                            device_id=torch.device(device) if on_cuda else None)
    try:
        with _quiet(rank() != 0):
            yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _quiet(quiet: bool):
    """While ``quiet``: log records below ERROR, warnings and what is printed (lm-eval's progress
    bars) dropped. Errors still show: log handlers keep the real stderr, and an exception is
    printed after the streams are restored."""
    if not quiet:
        yield
        return
    logging.disable(logging.WARNING)
    try:
        with open(os.devnull, "w") as sink, warnings.catch_warnings(), \
                contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def shard(items: list) -> list:
    """This rank's items, dealt round-robin (lm-eval's ``islice(docs, rank, None, world_size)``)."""
    return items[rank()::world_size()]


def all_gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order (a 0-d tensor as one
    element), as accelerate's ``gather``, which HFLM's ``all_gather`` calls."""
    if world_size() == 1:
        return tensor
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor)
    return torch.cat(parts)


def gather_objects(obj, dst: int = 0) -> list | None:
    """Every rank's ``obj`` in rank order on ``dst``, None on the others."""
    if world_size() == 1:
        return [obj]
    gathered = [None] * world_size() if rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst)
    return gathered


def all_gather_objects(obj) -> list:
    """Every rank's ``obj`` in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def rank0_first(prepare):
    """``prepare()`` on rank 0, then on the other ranks once rank 0 has finished (so that they
    load what it saved). When rank 0 fails, the others stop with an error instead of waiting."""
    if world_size() == 1:
        return prepare()
    if rank() == 0:
        try:
            result = prepare()
        except BaseException:
            dist.broadcast_object_list([False], src=0)
            raise
        dist.broadcast_object_list([True], src=0)
        return result
    status = [None]
    dist.broadcast_object_list(status, src=0)
    if not status[0]:
        raise QuambaError(f"rank {rank()}: stopped, rank 0 failed to prepare the model")
    return prepare()
