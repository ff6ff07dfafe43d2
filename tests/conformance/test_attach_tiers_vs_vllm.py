"""vLLM's tiers in attach's hash slots: the CPU tier as vLLM 0.33's offloading connector publishes
it (its own `OffloadingEventsTracker`, both forms) and a STORAGE tier, decoded by the mirror and
drawn as a grid per tier: each tier's grid holds exactly the mirror's resident hashes of that
tier, a cell says the other tiers holding its (group, hash), and a recording of the attached
session replays the same tiers step by step (a tier that appears or changes form mid-run
included)."""

from __future__ import annotations

import pytest
import vllm_ref as vr
from test_tiers_vs_vllm import Connector, apply

from kvscope.app.panels.pool_host import describe_host_block, device_copy
from kvscope.engine.snapshot import CACHED
from kvscope.sessions import SessionReader
from kvscope.sessions.kv_events import Mirror
from kvscope.sessions.kv_events.session import AttachSession
from kvscope.sessions.kv_events.slots import HashSlots, short_key


def to_storage(c: Connector, chunks: list[int], removed: bool = False) -> list:
    event = vr.OffloadingEvent([c.keys[i] for i in chunks], vr.Medium.STORAGE, removed)
    return list(c.tracker.take_events([event]))


def offload(c: Connector, chunks: list[int]) -> list:
    """The chunks stored on the CPU tier; a self-describing connector records what it stores
    first (as vLLM's offloading manager does), else it falls back to placeholders."""
    for chunk in chunks:
        c.tracker.record_store(c.req, c.group, chunk, c.keys[chunk])
    return c.offload(chunks)


def grids(snap) -> dict[str, set[int]]:
    """Each tier's resident short hashes, as its grid holds them (tiers holding some)."""
    held = {t.medium: {int(h) for h in t.block_hash[t.state == CACHED]} for t in snap.tiers()}
    return {medium: hashes for medium, hashes in held.items() if hashes}


def mirrored(m: Mirror) -> dict[str, set[int]]:
    """Each tier's resident (group, hash) as the mirror holds them, as short hashes."""
    out: dict[str, set[int]] = {}
    for rank, group, medium, h in m.blocks:
        out.setdefault(medium, set()).add(short_key(rank, group, h))
    return out


def cell(snap, medium: str, h) -> int:
    """The cell of a tier below the GPU holding hash h, numbered through the lower grids."""
    offset = 0
    for t in snap.tiers()[1:]:
        if t.medium == medium:
            return offset + int((t.block_hash == short_key(0, 0, h)).nonzero()[0][0])
        offset += t.num_blocks
    raise KeyError(medium)


@pytest.mark.parametrize("self_describing", [False, True])
def test_a_cpu_tier_in_either_form_is_a_grid_of_its_own(self_describing):
    c, m = Connector(self_describing), Mirror()
    slots = HashSlots(m, num_slots=16)
    apply(m, c.gpu_store())
    apply(m, offload(c, [0, 1]))
    slots.tick(0.0, 0.1)
    snap = slots.snapshot()
    assert [t.medium for t in snap.tiers()] == ["GPU", "CPU"]
    assert grids(snap) == mirrored(m)
    form = "self-describing" if self_describing else "placeholder"
    assert snap.host.forms == (form,) and snap.host.num_blocks == snap.num_blocks == 16
    # a placeholder names each chunk's last hash only; a self-describing store every hash
    assert len(grids(snap)["CPU"]) == (4 if self_describing else 2)
    # residency: a CPU cell names the GPU slot holding its hash, and the GPU cell the CPU's
    on_gpu = int((snap.block_hash == short_key(0, 0, c.h[3])).nonzero()[0][0])
    text = describe_host_block(snap, cell(snap, "CPU", c.h[3]))
    assert text.startswith(f"CPU hash slot {cell(snap, 'CPU', c.h[3])} · resident · also in "
                           f"GPU (slot {on_gpu})"), text
    assert device_copy(snap, on_gpu) == f" · also in CPU (slot {cell(snap, 'CPU', c.h[3])})"
    # the chunk removed from the CPU: gone from its grid, the GPU's copy only there
    apply(m, c.offload([1], removed=True))
    slots.tick(0.1, 0.1)
    snap = slots.snapshot()
    assert grids(snap) == mirrored(m) and short_key(0, 0, c.h[3]) not in grids(snap)["CPU"]
    assert device_copy(snap, on_gpu) == " · only in GPU"


def test_gpu_cpu_and_storage_are_three_grids_and_a_hash_names_the_other_two():
    c, m = Connector(self_describing=False), Mirror()
    slots = HashSlots(m, num_slots=16)
    apply(m, c.gpu_store())
    apply(m, c.offload([0, 1]))
    apply(m, to_storage(c, [1]))
    slots.tick(0.0, 0.1)
    snap = slots.snapshot()
    assert [t.medium for t in snap.tiers()] == ["GPU", "CPU", "STORAGE"]
    assert grids(snap) == mirrored(m)
    assert m.residency(0, c.h[3]) == {"GPU", "CPU", "STORAGE"}
    text = describe_host_block(snap, cell(snap, "STORAGE", c.h[3]))
    gpu = int((snap.block_hash == short_key(0, 0, c.h[3])).nonzero()[0][0])
    assert f"also in GPU (slot {gpu}), CPU (slot {cell(snap, 'CPU', c.h[3])})" in text, text
    # the mirror's own words (live: the server's hash) say the same tiers
    words = slots.describe(slots.slot_of[(0, 0, "STORAGE", c.h[3])], "STORAGE")
    assert words.startswith("STORAGE hash slot") and "also in GPU (slot" in words
    assert ", CPU (slot" in words


def test_a_recorded_attached_session_replays_its_tiers(tmp_path):
    """Steps: GPU only; a CPU tier (placeholders); STORAGE appears; CPU turns mixed (a
    self-describing store too); a removal. Each appearance or change of form must come with a
    keyframe: replay builds the tiers from one."""
    path = tmp_path / "tiers.kvscope"
    c, sd = Connector(self_describing=False), Connector(self_describing=True)
    session = AttachSession("tcp://127.0.0.1:9", record=str(path), num_slots=16)
    steps = [c.gpu_store(), c.offload([0]), to_storage(c, [1]),
             offload(sd, [1]), c.offload([0], removed=True) + to_storage(c, [1], removed=True)]
    live = {}
    try:
        for events in steps:
            apply(session.mirror, events)
            session.tick(0.1)
            live[session.latest.step] = session.latest
            assert grids(session.latest) == mirrored(session.mirror)
    finally:
        session.close()
    assert live[max(live)].host.forms == ("placeholder", "self-describing")
    with SessionReader(path) as reader:
        for step, want in live.items():
            got = reader.snapshot_at(step)
            assert [(t.medium, t.forms) for t in got.tiers()] == \
                [(t.medium, t.forms) for t in want.tiers()], step
            assert grids(got) == grids(want), step
            for a, b in zip(got.tiers(), want.tiers(), strict=True):
                assert (a.state == b.state).all() and (a.block_hash == b.block_hash).all()
