"""Compile-ahead (nvcli/kernels/compile_ahead.py): needs a GPU (the Triton interpreter compiles nothing)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import triton
import triton.language as tl

from nvcli.kernels.compile_ahead import compile_ahead, compile_variants, skipping_uncompiled_launches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or triton.knobs.runtime.interpret,
                                reason="compiles for a GPU")


@triton.jit
def _add_one_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


def _launch(x: torch.Tensor, y: torch.Tensor, block: int) -> None:
    _add_one_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block)


def _two_variants(n: int, block: int) -> tuple[list[torch.Tensor], list[torch.Tensor], Callable[[], None]]:
    """Inputs of n and n - 1 elements (two integer specializations of the kernel), outputs filled with -7 (what a
    skipped launch leaves them), and a pass that launches the kernel on both."""
    dev = torch.device("cuda", torch.cuda.current_device())
    xs = [torch.arange(size, dtype=torch.float32, device=dev) for size in (n, n - 1)]
    ys = [torch.full_like(x, -7.0) for x in xs]

    def launch_both() -> None:
        for x, y in zip(xs, ys):
            _launch(x, y, block)

    return xs, ys, launch_both


def _compiles_during(run: Callable[[], None]) -> list[str]:
    """The keys of the variants Triton compiles while `run()` launches (then synchronizes the device)."""
    compiles: list[str] = []
    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = lambda **kw: compiles.append(kw["key"])
    try:
        run()
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    torch.cuda.synchronize()
    return compiles


def test_skipped_launches_are_recorded_then_compiled_ahead():
    dev = torch.device("cuda", torch.cuda.current_device())
    xs, ys, launch_both = _two_variants(48, block=32)

    with skipping_uncompiled_launches() as variants:
        _launch(xs[0], ys[0], 32)  # the same variant as launch_both's first: recorded once
        launch_both()
    torch.cuda.synchronize()
    assert len(variants) == 2
    assert all(bool((y == -7.0).all()) for y in ys), "a skipped launch must write nothing"

    compile_variants(variants, dev, max_workers=2)

    assert _compiles_during(launch_both) == [], "the launches after compile_variants must find their kernels compiled"
    for x, y in zip(xs, ys):
        torch.testing.assert_close(y, x + 1)


def test_compile_ahead_leaves_every_variant_of_the_dry_pass_compiled():
    dev = torch.device("cuda", torch.cuda.current_device())
    xs, ys, dry_pass = _two_variants(64, block=64)

    num_variants, _ = compile_ahead(dry_pass, dev, max_workers=2)
    assert num_variants == 2
    assert all(bool((y == -7.0).all()) for y in ys), "the dry pass must launch nothing"
    assert _compiles_during(dry_pass) == []
    for x, y in zip(xs, ys):
        torch.testing.assert_close(y, x + 1)


def test_compile_ahead_in_worker_processes(tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """The engine's default: variants compile in forked worker processes into an empty disk cache, and the
    launches after compile_ahead find them all (none compiled here because a worker failed)."""
    from nvcli.kernels.compile_ahead import CompileWorkers

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    dev = torch.device("cuda", torch.cuda.current_device())
    xs, ys, dry_pass = _two_variants(128, block=128)

    workers = CompileWorkers(2)
    try:
        with caplog.at_level("WARNING", logger="nvcli"):
            num_variants, _ = compile_ahead(dry_pass, dev, max_workers=2, workers=workers)
    finally:
        workers.shutdown()
    assert num_variants == 2
    assert not [r for r in caplog.records if "compile worker failed" in r.getMessage()]
    assert any((tmp_path / "triton").rglob("*.cubin")), "the workers compile into the disk cache"
    assert _compiles_during(dry_pass) == []
    for x, y in zip(xs, ys):
        torch.testing.assert_close(y, x + 1)
