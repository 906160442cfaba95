"""What a user watches: the engine's stats (`engine.stats()`, as of its last step) and the
server's request counters, as `/v1/status` JSON and as `/metrics` Prometheus text."""

from __future__ import annotations

from typing import Any


def hit_rate(stats: dict[str, Any]) -> float:
    """Prefix-cache hits / lookups (0.0 before the first lookup)."""
    hits, misses = stats.get("prefix_hits", 0), stats.get("prefix_misses", 0)
    return hits / (hits + misses) if hits + misses else 0.0


def status(model: str, stats: dict[str, Any], counters: dict[str, int]) -> dict[str, Any]:
    """`/v1/status`: the figures most asked for first, then everything the engine reports."""
    return {
        "model": model,
        "running": stats.get("running", 0),
        "prefilling": stats.get("prefilling", 0),
        "queued": stats.get("queued", 0),
        "tokens_per_s": stats.get("tokens_per_s", 0.0),
        "generated_tokens": stats.get("generated_tokens", 0),
        "prefix_cache": {
            "hits": stats.get("prefix_hits", 0),
            "misses": stats.get("prefix_misses", 0),
            "hit_rate": hit_rate(stats),
            "bytes": stats.get("prefix_bytes", 0),
        },
        "requests": counters,
        "engine": stats,
    }


def prometheus_text(stats: dict[str, Any], counters: dict[str, int]) -> str:
    """Prometheus' text format: every numeric engine stat as gauge `kvstate_<name>`, the
    prefix-cache hit rate, and the request counters as `kvstate_requests_total{outcome}`."""
    lines = []
    numeric = {k: v for k, v in stats.items() if _number(v)}
    numeric["prefix_hit_rate"] = hit_rate(stats)
    for name, value in sorted(numeric.items()):
        metric = "kvstate_" + "".join(c if c.isalnum() else "_" for c in name)
        lines += [f"# TYPE {metric} gauge", f"{metric} {value}"]
    lines.append("# TYPE kvstate_requests_total counter")
    lines += [f'kvstate_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(counters.items())]
    return "\n".join(lines) + "\n"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
