"""distributed.all_reduce across gloo ranks: under --batch-invariant a row's sum has the same bits however many rows
share the message."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nvcli import distributed
from nvcli.engine.tp_executor import free_port

ROW_COUNTS = (1, 2, 3, 7, 64, 300)


def _sums_of_row_zero(rank: int, world: int, port: int, ordered: bool, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        distributed.set_rank_ordered_sums(ordered)
        g = torch.Generator().manual_seed(rank)
        parts = torch.randn(max(ROW_COUNTS), 64, generator=g) * torch.logspace(-3, 3, 64)  # [rows, hidden]
        sums = [distributed.all_reduce(parts[:rows].clone())[0] for rows in ROW_COUNTS]
        gathered = [torch.empty_like(parts) for _ in range(world)]
        dist.all_gather(gathered, parts)
        if rank == 0:
            torch.save((torch.stack(sums), torch.stack(gathered)[:, 0]), out)
    finally:
        dist.destroy_process_group()


def _run(world: int, ordered: bool, tmp_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    out = tmp_path / "sums.pt"
    mp.start_processes(_sums_of_row_zero, args=(world, free_port(), ordered, str(out)), nprocs=world,
                       start_method="spawn")
    return torch.load(out)


def test_rank_ordered_sums_do_not_depend_on_the_message_size(tmp_path: Path) -> None:
    sums, parts = _run(4, True, tmp_path)  # [len(ROW_COUNTS), hidden], [ranks, hidden]
    expected = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    for got in sums:
        assert torch.equal(got, expected)


def test_one_rank_is_left_alone() -> None:
    x = torch.randn(3, 8)
    distributed.set_rank_ordered_sums(True)
    try:
        assert distributed.all_reduce(x) is x
    finally:
        distributed.set_rank_ordered_sums(False)
