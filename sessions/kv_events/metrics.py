"""Scrape a vLLM or SGLang server's Prometheus endpoint (text format) for the numbers that sit
beside the KV events: prefix-cache queries and hits, KV usage, preemptions, TTFT and ITL.

    scraper = MetricsScraper("http://HOST:8000/metrics")
    point = scraper.scrape()   # MetricsPoint (cumulative values), or raises MetricsError

Values are summed over label sets (several engines or models behind one endpoint); KV usage is
averaged. Histograms give (sum, count): the mean over an interval is a difference of two points.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

MAX_BYTES = 16 << 20  # a metrics page larger than this is not one

# Our name -> the sample names that carry it, vLLM first, then SGLang's where it has one.
COUNTERS = {
    "queries": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries",
                "vllm:gpu_prefix_cache_queries_total"),
    "hits": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits",
             "vllm:gpu_prefix_cache_hits_total"),
    # SGLang's sglang:num_retracted_reqs is a gauge of the latest batch, not a count: not used
    "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions",
                    "sglang:num_retracted_requests_total"),
}
GAUGES = {  # fractions 0..1
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "hit_rate": ("sglang:cache_hit_rate",),  # SGLang publishes a ratio, not the counters
}
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
            "vllm:request_time_per_output_token_seconds", "sglang:inter_token_latency_seconds",
            "sglang:time_per_output_token_seconds"),
}


class MetricsError(ValueError):
    """The endpoint cannot be read or is not Prometheus text: one line saying which."""


@dataclass
class MetricsPoint:
    """One scrape: cumulative counters, gauges, and histogram (sum, count); None: not published."""

    queries: float | None = None
    hits: float | None = None
    preemptions: float | None = None
    kv_usage: float | None = None
    hit_rate: float | None = None
    ttft: tuple[float, float] | None = None
    itl: tuple[float, float] | None = None

    @property
    def known(self) -> list[str]:
        return [k for k, v in vars(self).items() if v is not None]


def parse_metrics(text: str) -> MetricsPoint:
    """The numbers kvscope uses from a Prometheus text page (MetricsError if it is not one)."""
    samples: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append(float(s.value))
    except Exception as e:  # noqa: BLE001 - the parser raises several types on garbage
        raise MetricsError(f"not Prometheus text format: {str(e).splitlines()[0][:120]}") \
            from None
    point = MetricsPoint()

    def first(names):
        return next((samples[n] for n in names if n in samples), None)

    for key, names in COUNTERS.items():
        if (v := first(names)) is not None:
            setattr(point, key, sum(v))
    for key, names in GAUGES.items():
        if (v := first(names)) is not None:
            setattr(point, key, sum(v) / len(v))
    for key, names in HISTOGRAMS.items():
        total = first([f"{n}_sum" for n in names])
        count = first([f"{n}_count" for n in names])
        if total is not None and count is not None:
            setattr(point, key, (sum(total), sum(count)))
    return point


def delta(a: MetricsPoint | None, b: MetricsPoint) -> dict[str, float]:
    """What happened between two scrapes: counter increases (a counter that went down means the
    server restarted: its new value), the gauges at b, and histogram means over the interval."""
    out: dict[str, float] = {}
    for key in COUNTERS:
        now = getattr(b, key)
        if now is not None:
            before = getattr(a, key) if a is not None else None
            out[key] = now if before is None or now < before else now - before
    for key in GAUGES:
        if getattr(b, key) is not None:
            out[key] = getattr(b, key)
    for key in HISTOGRAMS:
        now, before = getattr(b, key), getattr(a, key) if a is not None else None
        if now is not None and before is not None and now[1] > before[1]:
            out[key] = (now[0] - before[0]) / (now[1] - before[1])
    return out


class MetricsScraper:
    def __init__(self, url: str, timeout_s: float = 2.0):
        if not url.startswith(("http://", "https://")):
            raise MetricsError(f"metrics URL {url!r} is not http(s)://HOST:PORT/metrics")
        self.url, self.timeout_s = url, timeout_s
        self.last: MetricsPoint | None = None
        self.error: str | None = None  # the latest failure, one line (None: the last scrape worked)
        self.num_scrapes = self.num_failures = 0

    def scrape(self) -> MetricsPoint:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as r:  # noqa: S310
                body = r.read(MAX_BYTES + 1)
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise MetricsError(f"cannot read {self.url}: {reason}") from None
        if len(body) > MAX_BYTES:
            raise MetricsError(f"{self.url}: more than {MAX_BYTES >> 20} MiB: not a metrics page")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise MetricsError(f"{self.url}: not text (not Prometheus text format)") from None
        point = parse_metrics(text)
        if not point.known:
            raise MetricsError(f"{self.url}: no vLLM or SGLang metrics on the page")
        return point

    def poll(self) -> dict[str, float]:
        """Scrape once; the change since the previous good scrape ({} on failure: see error)."""
        self.num_scrapes += 1
        try:
            point = self.scrape()
        except MetricsError as e:
            self.num_failures += 1
            self.error = str(e)
            return {}
        self.error = None
        out, self.last = delta(self.last, point), point
        return out
