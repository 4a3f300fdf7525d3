"""The audit's HTML report: one self-contained file (inline CSS and SVG, no script, no network)."""

from __future__ import annotations

from datetime import UTC, datetime
from html import escape
from typing import Any

__all__ = ["copied_delay_note", "render_html"]

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d2433;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.muted{color:#667} .cards{display:flex;flex-wrap:wrap;gap:10px;margin:8px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:110px}
.card b{display:block;font-size:20px} .ok b{color:#1a7f37} .bad b{color:#cf222e} .info b{color:#1d2433}
table{border-collapse:collapse;margin:8px 0} td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f6f8fa} td.l{text-align:left;font-family:monospace}
svg text{font:11px system-ui,sans-serif;fill:#445}
"""


def _utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%H:%M:%S")


def _card(label: str, value: Any, bad: bool | None) -> str:
    """A figure; `bad` None: one the audit does not judge (no colour)."""
    judged = "info" if bad is None else "bad" if bad else "ok"
    return f'<div class="card {judged}"><b>{escape(str(value))}</b>{escape(label)}</div>'


def copied_delay_note(delay: dict[str, Any]) -> str:
    """What a tier's delay means when copies stored part of it."""
    return (
        f"{delay['by_copy']:,} of its {delay.get('count', 0):,} delays are of messages a copy stored "
        "(ferry copy, a fail-back, a repartition): the time until the copy ran, not end-to-end delay"
    )


def _timeline(buckets: list[dict[str, Any]], bucket_s: int, events: list[dict[str, Any]]) -> str:
    """Sent and stored per bucket (bars), the bucket's p99 delay from sent to stored (a line, its
    own scale on the right) and the operations' events (a mark each; a run of the same event, a
    band), on one axis of UTC time."""
    if not buckets:
        return "<p class=muted>no messages</p>"
    width, height, pad = 860, 260, 48
    plot_w, plot_h = width - 2 * pad, height - 2 * pad - 20
    t0 = min([buckets[0]["bucket"], *(e["t"] for e in events)])
    t1 = max([buckets[-1]["bucket"] + bucket_s, *(e["t"] for e in events)])
    span = max(t1 - t0, bucket_s)

    def x(t: float) -> float:
        return pad + plot_w * (t - t0) / span

    base = height - pad
    top = max(b["sent"] for b in buckets) or 1
    delays = [b["delay_p99_ms"] for b in buckets if "delay_p99_ms" in b]
    dtop = max(delays, default=0) or 1
    bar = max(plot_w * bucket_s / span - 2, 1)
    parts = [
        f'<svg role="img" aria-label="sent, stored, delay and events over time" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}">',
        f'<line x1="{pad}" y1="{base}" x2="{width - pad}" y2="{base}" stroke="#889"/>',
    ]
    for b in buckets:
        left, h_sent, h_ok = x(b["bucket"]) + 1, plot_h * b["sent"] / top, plot_h * b["present"] / top
        when = _utc(b["bucket"])
        parts.append(
            f'<rect x="{left:.1f}" y="{base - h_sent:.1f}" width="{bar:.1f}" height="{h_sent:.1f}" '
            f'fill="#d0d7de"><title>{when}: sent {b["sent"]:,}</title></rect>'
            f'<rect x="{left:.1f}" y="{base - h_ok:.1f}" width="{bar:.1f}" height="{h_ok:.1f}" fill="#2da44e" '
            f'fill-opacity="0.8"><title>{when}: stored {b["present"]:,}</title></rect>'
        )
        if lost := b["lost_acked"] + b["lost_not_asked"]:
            cx = left + bar / 2
            parts.append(
                f'<circle cx="{cx:.1f}" cy="{pad - 6}" r="5" fill="#cf222e"><title>{when}: {lost:,} lost</title>'
                f'</circle><text x="{cx:.1f}" y="{pad - 14}" text-anchor="middle">{lost:,} lost</text>'
            )
    line = [
        f"{x(b['bucket'] + bucket_s / 2):.1f},{base - plot_h * b['delay_p99_ms'] / dtop:.1f}"
        for b in buckets
        if "delay_p99_ms" in b
    ]
    if line:
        parts.append(f'<polyline points="{" ".join(line)}" fill="none" stroke="#0969da" stroke-width="2"/>')
        parts.append(
            f'<text x="{width - pad}" y="{pad + 8}" text-anchor="end" fill="#0969da">p99 delay, up to '
            f"{dtop:,.0f} ms</text>"
        )
    for run in _runs(events):
        first, last, n = run["first"], run["last"], run["count"]
        label = escape(_run_label(run))
        tip = f"{_run_span(run)}: {label}"
        if n > 1:
            parts.append(
                f'<rect x="{x(first):.1f}" y="{pad}" width="{max(x(last) - x(first), 2):.1f}" height="{plot_h}" '
                f'fill="#8250df" fill-opacity="0.10"><title>{tip}</title></rect>'
            )
        parts.append(
            f'<line x1="{x(first):.1f}" y1="{pad}" x2="{x(first):.1f}" y2="{base}" stroke="#8250df" '
            f'stroke-dasharray="3,3"><title>{tip}</title></line>'
            f'<text x="{x(first) + 3:.1f}" y="{pad + 12 + 12 * (run["row"] % 4)}" fill="#8250df">{label}</text>'
        )
    for k in range(6):  # the time axis, in UTC
        t = t0 + span * k / 5
        parts.append(f'<text x="{x(t):.1f}" y="{base + 16}" text-anchor="middle">{_utc(t)}</text>')
    parts.append(f'<text x="{pad}" y="{base + 34}">bars: {top:,} msgs / {bucket_s}s at most · UTC</text></svg>')
    return "".join(parts)


def _run_label(run: dict[str, Any]) -> str:
    return run["event"] + (f" ({run['count']} times)" if run["count"] > 1 else "")


def _run_span(run: dict[str, Any]) -> str:
    return _utc(run["first"]) + (f" to {_utc(run['last'])}" if run["count"] > 1 else "")


def _runs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive events of the same name and source as one run (first and last time, count)."""
    runs: list[dict[str, Any]] = []
    for e in sorted(events, key=lambda e: e["t"]):
        if runs and (runs[-1]["event"], runs[-1]["source"]) == (e["event"], e.get("source")):
            runs[-1]["last"], runs[-1]["count"] = e["t"], runs[-1]["count"] + 1
        else:
            runs.append({"event": e["event"], "source": e.get("source"), "first": e["t"], "last": e["t"], "count": 1})
    for i, r in enumerate(runs):
        r["row"] = i
    return runs


def _histogram(delay: dict[str, Any]) -> str:
    hist = delay.get("histogram") or []
    if not hist:
        return ""
    width, height, pad = 760, 180, 40
    top = max(h["count"] for h in hist) or 1
    step = (width - 2 * pad) / len(hist)
    parts = [
        f'<svg role="img" aria-label="delay histogram" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">'
    ]
    for i, h in enumerate(hist):
        x = pad + i * step
        bar = (height - 2 * pad) * h["count"] / top
        parts.append(
            f'<rect x="{x + 2:.1f}" y="{height - pad - bar:.1f}" width="{max(step - 4, 1):.1f}" '
            f'height="{bar:.1f}" fill="#0969da"><title>{h["count"]} messages</title></rect>'
            f'<text x="{x + step / 2:.1f}" y="{height - pad + 14}" text-anchor="middle">≤{h["le_ms"]}ms</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def render_html(report: dict[str, Any], verdict: list[str]) -> str:
    sent = report["sent"]
    duration = (sent.get("last_ns", 0) - sent.get("first_ns", 0)) / 1e9 if sent.get("sent") else 0
    ledgers = ", ".join(report["ledger"]) if isinstance(report["ledger"], list) else report["ledger"]
    events = report.get("events") or []
    first_ns = sent.get("first_ns") or 0
    out = [
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>ferry audit</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>ferry audit</h1>",
        f"<p class=muted>ledger {escape(ledgers)} · {sent.get('sent', 0):,} sent over {duration:.1f}s "
        f"from {_utc(first_ns / 1e9) if first_ns else '-'} UTC · "
        f"{sent.get('acked', 0):,} acked · {sent.get('errors', 0):,} publish errors · "
        f"{sent.get('not_asked', 0):,} fire-and-forget · buckets of {report['bucket_s']}s</p>",
        f"<p><b>{'PASS' if not verdict else 'FAIL: ' + escape('; '.join(verdict))}</b></p>",
    ]
    for name, t in report["tiers"].items():
        delay = t.get("delay")
        out.append(f"<h2>tier {escape(name)}</h2><div class=cards>")
        out += [
            _card("lost", t.get("lost", 0), t.get("lost", 0) > 0),
            _card("lost (acked)", t.get("lost_acked", 0), t.get("lost_acked", 0) > 0),
            _card("lost (fire-and-forget)", t.get("lost_not_asked", 0), t.get("lost_not_asked", 0) > 0),
            _card("duplicate copies", t.get("extra_copies", 0), t.get("extra_copies", 0) > 0),
            _card("unexpected", t.get("unexpected", 0), t.get("unexpected", 0) > 0),
            _card("reordered", t.get("reordered", 0), t.get("reordered", 0) > 0),
            _card("corrupted", t.get("corrupted", 0), t.get("corrupted", 0) > 0),
            _card("absent after a publish error", t.get("absent_after_error", 0), False),
        ]
        if delay:
            figures = f"{delay['p50_ms']:.1f} / {delay['p99_ms']:.1f}"
            out.append(_card("sent → stored here, p50 / p99 ms", figures, None))
        out.append(
            "</div><h3>sent (grey) and stored (green) per bucket, losses in red, p99 delay (blue)"
            + (", the operations' events (purple)" if events else "")
            + "</h3>"
        )
        out.append(_timeline(t["buckets"], report["bucket_s"], events))
        if delay:
            out.append("<h3>delay from sent to stored in this tier</h3>")
            if delay.get("by_copy"):
                out.append(f"<p class=muted>{escape(copied_delay_note(delay))}</p>")
            out.append(_histogram(delay))
        for label, key in (("lost", "lost_ids"), ("duplicated", "duplicated_ids"), ("corrupted", "corrupted_ids")):
            rows = t.get(key) or []
            if rows:
                out.append(
                    f"<h3>{label} ids: {len(rows):,}{'; the first 100 listed' if len(rows) > 100 else ''}</h3>"
                    "<table><tr><th>id</th><th>bucket (UTC)</th></tr>"
                )
                out += [f"<tr><td class=l>{escape(r['id'])}</td><td>{_utc(r['bucket'])}</td></tr>" for r in rows[:100]]
                out.append("</table>")
    if events:
        out.append("<h2>the operations' events</h2><table><tr><th>UTC</th><th>from</th><th>event</th></tr>")
        for r in _runs(events):
            cells = (_run_span(r), escape(r["source"] or ""), escape(_run_label(r)))
            out.append("<tr><td>{}</td><td class=l>{}</td><td class=l>{}</td></tr>".format(*cells))
        out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out)
