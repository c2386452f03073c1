"""distributed.all_reduce across gloo ranks: under --batch-invariant a row's sum has the same bits however many rows
share the message."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
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


def _symmetric_off_on_gloo(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ok = distributed.init_symmetric_all_reduce(1024, torch.float32, torch.device("cpu"))
        ok = ok or distributed.init_deferred_sums(1024, torch.float32, torch.device("cpu"))
        ok = ok or distributed.partial_target(4, 8, torch.float32, torch.device("cpu")) is not None
        x = torch.full((4, 8), float(rank + 1))
        y = distributed.all_reduce(x)
        if rank == 0:
            torch.save((ok, y is x, y), out)
    finally:
        distributed.release_symmetric_all_reduce()
        dist.destroy_process_group()


def test_symmetric_all_reduce_stays_off_on_cpu(tmp_path: Path) -> None:
    """Off CUDA the symmetric-memory path is never set up, and all_reduce still sums in place through gloo."""
    out = tmp_path / "symm.pt"
    mp.start_processes(_symmetric_off_on_gloo, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn")
    ok, same, y = torch.load(out)
    assert ok is False and same
    assert torch.equal(y, torch.full((4, 8), 3.0))


def _rendezvous_agreement(rank: int, world: int, port: int, made: list[int], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        distributed._rendezvous_made = made[rank]
        agreed = distributed._rendezvous_in_step(torch.device("cpu"))
        torch.save(agreed, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("made, expected", [([0, 0, 0], True), ([3, 3, 3], True), ([3, 0, 0], False),
                                            ([0, 0, 2], False)])
def test_peer_buffers_are_set_up_only_where_every_rank_is_in_step(tmp_path: Path, made: list[int],
                                                                  expected: bool) -> None:
    """A driver process that ran a tensor-parallel engine before has made rendezvous its new workers have not: torch
    would then wait forever on the next one. Every rank gets the same answer, so all take the same sum path."""
    out = tmp_path / "agreed"
    mp.start_processes(_rendezvous_agreement, args=(3, free_port(), made, str(out)), nprocs=3, start_method="spawn")
    assert [torch.load(f"{out}.{rank}") for rank in range(3)] == [expected] * 3


def test_symmetric_all_reduce_needs_several_ranks() -> None:
    assert distributed.init_symmetric_all_reduce(1024, torch.bfloat16, torch.device("cpu")) is False


@contextmanager
def _gpu_rank(rank: int, world: int, port: int) -> Iterator[torch.device]:
    """This process as NCCL rank `rank` on GPU `rank`; on the way out its peer-mapped buffers are dropped and the
    group destroyed (a test deletes its CUDA graphs before leaving the block)."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    try:
        yield device
    finally:
        distributed.release_deferred_sums()
        distributed.release_symmetric_all_reduce()
        dist.destroy_process_group()


def _spawn_on_gpus(fn: Callable[[int, int, int, str], None], world: int, tmp_path: Path) -> list:
    """fn(rank, world, port, out) on `world` GPUs, one process each (the test is skipped with fewer GPUs); returns
    the results tensor rank 0 saved to `out`, as a list."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    out = tmp_path / "results.pt"
    mp.start_processes(fn, args=(world, free_port(), str(out)), nprocs=world, start_method="spawn")
    return torch.load(out).tolist()


def _symmetric_matches_nccl(rank: int, world: int, port: int, out: str) -> None:
    with _gpu_rank(rank, world, port) as device:
        ok = distributed.init_symmetric_all_reduce(256 * 512, torch.bfloat16, device)
        g = torch.Generator(device="cuda").manual_seed(rank)
        parts = torch.randn(300, 512, generator=g, device="cuda", dtype=torch.bfloat16)
        reference = parts.clone()
        dist.all_reduce(reference)  # NCCL
        eager = distributed.all_reduce(parts[:256].clone())
        big = distributed.all_reduce(parts.clone())  # over the buffer: NCCL
        x = parts[:128].clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            distributed.all_reduce(x.copy_(parts[:128]))  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            distributed.all_reduce(x.copy_(parts[:128]))
        x.zero_()
        graph.replay()
        torch.cuda.synchronize()
        results = torch.tensor([ok, torch.equal(eager, reference[:256]), torch.equal(big, reference),
                                torch.equal(x, reference[:128])])
        gathered = [torch.empty_like(eager) for _ in range(world)]
        dist.all_gather(gathered, eager)  # every rank the same bits
        results = torch.cat([results, torch.tensor([all(torch.equal(gathered[0], t) for t in gathered)])])
        if rank == 0:
            torch.save(results, out)
        del graph


def test_symmetric_all_reduce_matches_nccl_on_two_gpus(tmp_path: Path) -> None:
    """Two ranks: a + b has one rounding, so two-shot (eager and replayed from a CUDA graph) equals NCCL's bits."""
    ok, eager, big, graphed, same = _spawn_on_gpus(_symmetric_matches_nccl, 2, tmp_path)
    assert ok, "symmetric memory did not set up (see the log for why)"
    assert eager and big and graphed and same


def _deferred_matches_rank_ordered_sums(rank: int, world: int, port: int, out: str) -> None:
    with _gpu_rank(rank, world, port) as device:
        from nvcli.kernels.rms_norm import rms_norm_triton

        ok = distributed.init_symmetric_all_reduce(256 * 512, torch.bfloat16, device)
        ok = ok and distributed.init_deferred_sums(256 * 512, torch.bfloat16, device)
        g = torch.Generator(device="cuda").manual_seed(rank)
        common = torch.Generator(device="cuda").manual_seed(99)
        weight = 1 + 0.1 * torch.randn(512, generator=common, device="cuda", dtype=torch.bfloat16)
        eye = torch.eye(512, device="cuda", dtype=torch.bfloat16)
        same = True
        distributed.begin_forward()
        # eight sums in a row, the buffers in turn (each refilled while a peer may just have read the other)
        for rows in (40, 100, 100, 40, 7, 40, 3, 100):
            part = torch.randn(rows, 512, generator=g, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(rows, 512, generator=common, device="cuda", dtype=torch.bfloat16)
            shares = [torch.empty_like(part) for _ in range(world)]
            dist.all_gather(shares, part)
            total = shares[0].float()
            for share in shares[1:]:  # rank order, fp32, rounded once
                total += share.float()
            want_normed, want_res = rms_norm_triton(total.to(torch.bfloat16), weight, 1e-6, residual)
            p = distributed.partial_target(rows, 512, torch.bfloat16, device)
            assert p is not None
            torch.mm(part, eye, out=p.local)
            normed, new_res = distributed.sum_add_norm(p, residual, weight, 1e-6)
            same = same and torch.equal(normed, want_normed) and torch.equal(new_res, want_res)
        distributed.end_forward()
        torch.cuda.synchronize()
        results = torch.tensor([ok, same])
        if rank == 0:
            torch.save(results, out)


@pytest.mark.parametrize("world", [2, 4])
def test_deferred_sums_are_the_rank_ordered_sum_then_the_norm(world: int, tmp_path: Path) -> None:
    """A projection's share written into a deferred-sum buffer and summed inside the add+RMSNorm path
    (distributed.sum_add_norm) gives on every rank the bits of the shares summed in rank order and then
    add+RMSNorm."""
    ok, same = _spawn_on_gpus(_deferred_matches_rank_ordered_sums, world, tmp_path)
    assert ok, "symmetric memory or the deferred sums did not set up (see the log for why)"
    assert same


def _in_place_matches_all_reduce_then_norm(rank: int, world: int, port: int, out: str) -> None:
    with _gpu_rank(rank, world, port) as device:
        from nvcli.kernels.rms_norm import rms_norm_triton

        ok = distributed.init_symmetric_all_reduce(256 * 512, torch.bfloat16, device)
        g = torch.Generator(device="cuda").manual_seed(rank)
        common = torch.Generator(device="cuda").manual_seed(99)
        weight = 1 + 0.1 * torch.randn(512, generator=common, device="cuda", dtype=torch.bfloat16)
        eye = torch.eye(512, device="cuda", dtype=torch.bfloat16)

        def layer(part: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """A row-parallel GEMM into the buffer, its sum in place, the next add+RMSNorm reading it."""
            target = distributed.reduce_target(part.shape[0], 512, torch.bfloat16, device)
            assert target is not None
            torch.mm(part, eye, out=target)
            return distributed.sum_add_norm(distributed.summed_in_place(target), residual, weight, 1e-6)

        same, agree = True, True
        sequence = [(torch.randn(rows, 512, generator=g, device="cuda", dtype=torch.bfloat16),
                     torch.randn(rows, 512, generator=common, device="cuda", dtype=torch.bfloat16))
                    for rows in (40, 256, 100, 8, 256, 64)]
        for part, residual in sequence:  # each sum refills the buffer the previous one was read from
            want = rms_norm_triton(distributed.all_reduce(part.clone()), weight, 1e-6, residual)
            got = layer(part, residual)
            same = same and all(torch.equal(a, b) for a, b in zip(got, want))
            gathered = [torch.empty_like(got[0]) for _ in range(world)]
            dist.all_gather(gathered, got[0])
            agree = agree and all(torch.equal(gathered[0], t) for t in gathered)
        # two sums in a row inside one CUDA graph (o_proj then down_proj of a decode step), replayed
        (a, ra), (b, rb) = sequence[1], sequence[4]
        want_a, want_b = layer(a, ra), layer(b, rb)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer(a, ra)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_a, out_b = layer(a, ra), layer(b, rb)
        graph.replay()
        torch.cuda.synchronize()
        graphed = all(torch.equal(x, y) for x, y in zip(out_a + out_b, want_a + want_b))
        results = torch.tensor([ok, same, agree, graphed])
        if rank == 0:
            torch.save(results, out)
        del graph


@pytest.mark.parametrize("world", [2, 4])
def test_a_sum_in_place_is_the_all_reduce_then_the_norm(world: int, tmp_path: Path) -> None:
    """A projection's share written into the symmetric all-reduce's buffer, summed there and read by the add+RMSNorm
    (distributed.summed_in_place, no copies) gives the bits of all_reduce then add+RMSNorm, on every rank, eager
    and replayed from a CUDA graph, each sum refilling the buffer the one before was read from."""
    ok, same, agree, graphed = _spawn_on_gpus(_in_place_matches_all_reduce_then_norm, world, tmp_path)
    assert ok, "symmetric memory did not set up (see the log for why)"
    assert same and agree and graphed
