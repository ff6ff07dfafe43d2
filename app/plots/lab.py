"""The lab's miss-ratio curves, drawn once for the Lab panel and the PNG export: token hit ratio
against pool size (log), LRU from the one-pass curve (with KV-cache groups: replays), the other
policies and Belady at the sizes replayed, the infinite-cache ceiling as a dashed line; with host
tiers (report.tier_curve) the curve per tier: for each host size the hit ratio with the tier
(solid) and the part of it from the host (dotted), against the device pool's size."""

from __future__ import annotations

from pathlib import Path

from kvscope.app import palette
from kvscope.app.plots.axes import percent_axis
from kvscope.app.plots.png import write_plot_png
from kvscope.lab.report import Row, lab_policies

COLORS = {"lru": palette.ACTIVE_COLOR, "fifo": palette.SHARED_COLOR,
          "lfu": palette.DECODE_COLOR, "belady": palette.CACHED_COLOR,
          "infinite": palette.EVICTED_COLOR}
OTHER_COLORS = (palette.PREFILL_COLOR, "#f0e442", "#000000")  # the rest of Okabe-Ito's
HOST_COLORS = ("#000000", palette.PREFILL_COLOR, "#f0e442", palette.DECODE_COLOR)


def color(policy: str) -> str:
    """A policy's colour: its own, or one of the spare ones by its place in the table."""
    if policy in COLORS:
        return COLORS[policy]
    return OTHER_COLORS[lab_policies().index(policy) % len(OTHER_COLORS)]


def draw_curves(item, lru_curve: list[tuple[int, float]], rows: list[Row],
                tier_curve: list[Row] = ()) -> None:
    """Draw on a pyqtgraph PlotItem (cleared first)."""
    import pyqtgraph as pg

    item.clear()
    if item.legend is None:
        item.addLegend(offset=(10, 10))
    item.setLogMode(x=True, y=False)
    item.setLabel("bottom", "pool size (blocks)")
    item.getAxis("bottom").setTicks(None)  # (a bill's cost curve names its TTLs)
    item.setLabel("left", "token hit ratio")
    percent_axis(item.getAxis("left"), True)
    item.showGrid(x=True, y=True, alpha=0.3)
    xs, ys = zip(*lru_curve, strict=True)
    one_pass = all(r.groups == "full" for r in rows)  # (KV-cache groups: replayed per size)
    item.plot(xs, [100 * y for y in ys], pen=pg.mkPen(COLORS["lru"], width=2),
              name="lru (one pass)" if one_pass else "lru")
    for policy in lab_policies():
        pts = sorted((r.pool_blocks, r.token_hit_ratio) for r in rows
                     if r.policy == policy and not r.host_blocks)
        if pts:
            px, py = zip(*pts, strict=True)
            item.plot(px, [100 * y for y in py],
                      pen=None if policy == "lru" else pg.mkPen(color(policy), width=2),
                      symbol="o", symbolBrush=color(policy), symbolPen=None,
                      name=None if policy == "lru" else policy)
    for r in rows:
        if r.policy == "infinite":
            pen = pg.mkPen(COLORS["infinite"], width=2, style=pg.QtCore.Qt.PenStyle.DashLine)
            item.addItem(pg.InfiniteLine(100 * r.token_hit_ratio, angle=0, pen=pen))
            item.legend.addItem(pg.PlotDataItem(pen=pen), "infinite cache")
    hosts = sorted({r.host_blocks for r in tier_curve if r.host_blocks})
    for i, host in enumerate(hosts):
        line = sorted((r for r in tier_curve if r.host_blocks == host),
                      key=lambda r: r.pool_blocks)
        px = [r.pool_blocks for r in line]
        c = HOST_COLORS[i % len(HOST_COLORS)]
        item.plot(px, [100 * r.token_hit_ratio for r in line], pen=pg.mkPen(c, width=2),
                  symbol="t", symbolBrush=c, symbolPen=None,
                  name=f"{line[0].policy} + host {host:,} ({line[0].host_policy})")
        item.plot(px, [100 * r.host_hit_ratio for r in line],
                  pen=pg.mkPen(c, width=1, style=pg.QtCore.Qt.PenStyle.DotLine),
                  name=f"from host {host:,}")


def write_curves_png(path: Path, lru_curve: list[tuple[int, float]], rows: list[Row],
                     tier_curve: list[Row] = (), width: int = 900) -> None:
    write_plot_png(path, lambda item: draw_curves(item, lru_curve, rows, tier_curve), width)


ROUTER_COLORS = (palette.SHARED_COLOR, palette.DECODE_COLOR, palette.PREFILL_COLOR,
                 palette.CACHED_COLOR, palette.ACTIVE_COLOR, "#f0e442")


def draw_routing_curves(item, points: dict[str, list[tuple[int, float]]], replicas: int) -> None:
    """The miss-ratio curve per router (lab.routing.curve): the fleet's token hit ratio against
    the pool size per replica (log); one pool of the fleet's size dashed."""
    import pyqtgraph as pg

    item.clear()
    if item.legend is None:
        item.addLegend(offset=(10, 10))
    item.setLogMode(x=True, y=False)
    item.setLabel("bottom", f"pool size per replica (blocks; {replicas} replicas)")
    item.setLabel("left", "fleet token hit ratio")
    percent_axis(item.getAxis("left"), True)
    item.showGrid(x=True, y=True, alpha=0.3)
    for i, (name, pts) in enumerate(points.items()):
        xs, ys = zip(*pts, strict=True)
        if name == "one pool":
            pen = pg.mkPen(COLORS["infinite"], width=2, style=pg.QtCore.Qt.PenStyle.DashLine)
            item.plot(xs, [100 * y for y in ys], pen=pen, name=f"one pool of {replicas}x")
            continue
        c = ROUTER_COLORS[i % len(ROUTER_COLORS)]
        item.plot(xs, [100 * y for y in ys], pen=pg.mkPen(c, width=2), symbol="o",
                  symbolBrush=c, symbolPen=None, name=name)


def write_routing_png(path: Path, points: dict[str, list[tuple[int, float]]], replicas: int,
                      width: int = 900) -> None:
    write_plot_png(path, lambda item: draw_routing_curves(item, points, replicas), width)
