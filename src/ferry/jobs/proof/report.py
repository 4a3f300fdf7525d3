"""The audit's HTML report: one self-contained file (inline CSS and SVG, no script, no network)."""

from __future__ import annotations

from datetime import UTC, datetime
from html import escape
from typing import Any

__all__ = ["render_html"]

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d2433;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.muted{color:#667} .cards{display:flex;flex-wrap:wrap;gap:10px;margin:8px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:110px}
.card b{display:block;font-size:20px} .ok b{color:#1a7f37} .bad b{color:#cf222e}
table{border-collapse:collapse;margin:8px 0} td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f6f8fa} td.l{text-align:left;font-family:monospace}
svg text{font:11px system-ui,sans-serif;fill:#445}
"""


def _utc(epoch_s: int) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%H:%M:%S")


def _card(label: str, value: Any, bad: bool) -> str:
    return f'<div class="card {"bad" if bad else "ok"}"><b>{escape(str(value))}</b>{escape(label)}</div>'


def _timeline(buckets: list[dict[str, Any]], bucket_s: int) -> str:
    if not buckets:
        return "<p class=muted>no messages</p>"
    width, height, pad = 760, 220, 40
    top = max(b["sent"] for b in buckets) or 1
    step = (width - 2 * pad) / len(buckets)
    first = buckets[0]["bucket"]
    parts = [
        f'<svg role="img" aria-label="sent and stored per bucket" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#889"/>',
    ]
    for i, b in enumerate(buckets):
        x = pad + i * step
        h_sent = (height - 2 * pad) * b["sent"] / top
        h_ok = (height - 2 * pad) * b["present"] / top
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{height - pad - h_sent:.1f}" width="{max(step - 2, 1):.1f}" '
            f'height="{h_sent:.1f}" fill="#d0d7de"><title>sent {b["sent"]}</title></rect>'
        )
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{height - pad - h_ok:.1f}" width="{max(step - 2, 1):.1f}" '
            f'height="{h_ok:.1f}" fill="#2da44e" fill-opacity="0.8"><title>stored {b["present"]}</title></rect>'
        )
        lost = b["lost_acked"] + b["lost_not_asked"]
        if lost:
            cx = x + step / 2
            parts.append(
                f'<circle cx="{cx:.1f}" cy="{pad - 14}" r="6" fill="#cf222e"/>'
                f'<text x="{cx:.1f}" y="{pad - 24}" text-anchor="middle">{lost} lost</text>'
            )
        if i % max(1, len(buckets) // 8) == 0:
            parts.append(f'<text x="{x:.1f}" y="{height - pad + 16}">+{b["bucket"] - first}s</text>')
    parts.append(f'<text x="{pad}" y="{pad - 2}">{top:,} msgs / {bucket_s}s</text></svg>')
    return "".join(parts)


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
    out = [
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>ferry audit</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>ferry audit</h1>",
        f"<p class=muted>ledger {escape(ledgers)} · {sent.get('sent', 0):,} sent over {duration:.1f}s · "
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
            out.append(_card("delay p50 / p99 ms", f"{delay['p50_ms']:.1f} / {delay['p99_ms']:.1f}", False))
        out.append("</div><h3>sent (grey) and stored (green) per bucket; losses in red</h3>")
        out.append(_timeline(t["buckets"], report["bucket_s"]))
        if delay:
            out.append("<h3>end-to-end delay</h3>" + _histogram(delay))
        for label, key in (("lost", "lost_ids"), ("duplicated", "duplicated_ids"), ("corrupted", "corrupted_ids")):
            rows = t.get(key) or []
            if rows:
                out.append(
                    f"<h3>{label} ids: {len(rows):,}{'; the first 100 listed' if len(rows) > 100 else ''}</h3>"
                    "<table><tr><th>id</th><th>bucket (UTC)</th></tr>"
                )
                out += [f"<tr><td class=l>{escape(r['id'])}</td><td>{_utc(r['bucket'])}</td></tr>" for r in rows[:100]]
                out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out)
