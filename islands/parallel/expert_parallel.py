"""Rows of a batch sent to the ranks that own what they need, and answers sent back: the all-to-all exchange of
expert parallelism at inference (each rank holds some of an ensemble's experts)."""

import torch
import torch.distributed as dist

from islands.parallel.launch import World
from islands.parallel.ledger import Ledger


def exchange(parts: list[list[torch.Tensor]], world: World, ledger: Ledger | None = None) -> list[list[torch.Tensor]]:
    """parts[d]: the tensors this rank sends to rank d, each with the same number of rows (and, slot by slot, the
    same trailing shape and dtype on every rank). -> for each source rank s, the tensors s sent here, in its order.
    Two all_to_all_single calls per slot kind: the row counts, then each tensor's rows."""
    # the counts travel where the rows do, so that one backend carries the whole exchange
    sizes = torch.tensor([p[0].shape[0] for p in parts], dtype=torch.long, device=parts[0][0].device)
    incoming = torch.empty_like(sizes)
    dist.all_to_all_single(incoming, sizes, group=world.group)
    send_splits, recv_splits = sizes.tolist(), incoming.tolist()
    received = [[] for _ in parts]
    for slot in range(len(parts[0])):
        send = torch.cat([p[slot] for p in parts]).contiguous()
        out = send.new_empty((sum(recv_splits), *send.shape[1:]))
        dist.all_to_all_single(out, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                               group=world.group)
        if ledger is not None:  # what leaves this rank: every row not addressed to itself
            row = send[0].numel() * send.element_size() if len(send) else 0
            ledger.record("all_to_all", row * (sum(send_splits) - send_splits[world.rank]))
        for source, chunk in enumerate(out.split(recv_splits)):
            received[source].append(chunk)
    return received


def send_to(x: torch.Tensor, rank: int) -> int:
    """x to `rank` of the job (blocking until it is taken); -> the bytes sent."""
    x = x.contiguous()
    dist.send(x, dst=rank)
    return x.numel() * x.element_size()


def receive_from(shape: tuple, rank: int, dtype=torch.float32) -> torch.Tensor:
    """A tensor of `shape` from `rank` of the job."""
    x = torch.empty(shape, dtype=dtype)
    dist.recv(x, src=rank)
    return x
