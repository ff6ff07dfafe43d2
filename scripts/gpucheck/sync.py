"""No host synchronisation in a prefill and a decode forward; engine step timing and
recompilation on a real engine."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from gpucheck.plan import BLOCK_SIZE, Plan
from gpucheck.report import Report
from gpucheck.tensors import free_memory, time_call
from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.engine.host_sync import no_host_sync
from kvscope.engine.model_runner import ModelRunner, SeqChunk
from kvscope.engine.models.load import load_model


def check_sync(report: Report, folder: Path, plan: Plan, device) -> None:
    """A prefill forward (one new sequence, one over a cached prefix) and a decode forward
    with a copy-on-write block copy make no host synchronisation once warmed up."""
    impl = "triton"  # on the CPU too: the dry run checks the triton path under the interpreter
    runner = ModelRunner(load_model(folder, device, "bfloat16"), num_blocks=64,
                         block_size=BLOCK_SIZE, kernel_impl=impl)

    def forwards(first_block: int):
        a = list(range(first_block, first_block + 4))
        b = list(range(first_block + 4, first_block + 8))
        prefill = [SeqChunk(list(range(3, 43)), 0, a[:3]), SeqChunk(list(range(5, 25)), 0, b[:2])]
        mixed = [SeqChunk([7] * 8, 40, a[:3]), SeqChunk([9] * 4, 20, b[:2])]
        decode = [SeqChunk([11], 48, a[:4]), SeqChunk([12], 24, b[:2])]
        return prefill, mixed, decode, [(a[0], first_block + 30)]

    prefill, mixed, decode, copies = forwards(0)
    if device.type == "cuda":  # warm-up: kernel compilation, first transfers (none interpreted)
        for chunks in (prefill, mixed, decode):
            runner.run(chunks, copies)
    prefill, mixed, decode, copies = forwards(10)
    runner.run(prefill)
    for name, chunks, cp in (("prefill over a cached prefix", mixed, ()),
                             ("decode with a block copy", decode, copies)):
        try:
            with no_host_sync(device):
                runner.run(chunks, cp)
            ok, value = True, "no host sync"
        except RuntimeError as e:
            ok, value = False, str(e).splitlines()[0][:120]
        t = time_call(lambda c=chunks: runner.run(c), plan.timing_iters, device)
        clock = "CUDA events" if device.type == "cuda" else "perf_counter (CPU)"
        report.add("sync", f"{name} forward (2 seqs)", ok, f"{value}; {t * 1e3:.2f} ms ({clock})",
                   "no sync", {"seconds": t})


def check_engine_step(report: Report, folder: Path, device) -> None:
    """An engine decode step: its host syncs (the sampler's transfer is the one expected) and
    whether its forward timing came from CUDA events; then the triton kernels compiled while
    contexts grow past block and split boundaries (none should be: a compile stalls a step)."""
    case, cuda = "engine decode step (4 seqs)", device.type == "cuda"
    engine = Engine.from_pretrained(str(folder), EngineConfig(
        device=device.type, dtype="bfloat16", num_blocks=256, block_size=BLOCK_SIZE))
    for n in (250, 9, 33, 4):  # the longest crosses 256 tokens: the decode split count changes
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=24, ignore_eos=True))
    for _ in range(3):  # prefill, then decode steps
        engine.step()
    events = []
    real_event = torch.cuda.Event

    def counting_event(*args, **kwargs):
        events.append(kwargs.get("enable_timing", False))
        return real_event(*args, **kwargs)

    previous = torch.cuda.get_sync_debug_mode() if cuda else None
    try:
        if cuda:
            torch.cuda.Event = counting_event
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.Event = real_event
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    engine.step()  # a step later: where the timing may be read from its events
    decode_s = max(r.decode_s for r in engine.step_records[-2:])
    timed = sum(events) >= 2 and decode_s > 0
    value = (f"{syncs} host syncs; timing from CUDA events: {'yes' if timed else 'no'} "
             f"(decode {decode_s * 1e3:.2f} ms)")
    report.add("sync", case, syncs <= 1 and timed if cuda else None,
               value if cuda else "CPU dry run: no CUDA syncs or events",
               "<= 1 sync; CUDA-event timing",
               {"syncs": syncs, "timing_events": sum(events), "decode_s": decode_s})
    before = _compiled_variants()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    after = _compiled_variants()
    grown = None if before is None or after is None else after - before
    report.add("sync", f"kernel compilations in {steps} later decode steps",
               None if grown is None else grown == 0,
               "not countable in this triton" if grown is None else str(grown), "0",
               {"before": before, "after": after})
    del engine
    free_memory(device)


def _compiled_variants() -> int | None:
    """Compiled variants of the attention and store kernels (triton internals: best effort)."""
    from kvscope.kernels import triton_attention, triton_store

    kernels = (triton_attention._prefill_kernel, triton_attention._decode_split_kernel,
               triton_attention._decode_reduce_kernel, triton_store._store_kv_kernel)
    try:
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())
    except (AttributeError, TypeError, IndexError, KeyError):
        return None
