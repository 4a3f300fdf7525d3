// ferry's operations console: polls /api/console once a second and renders it. Every value is
// set with textContent (names are user data). The bearer token, when serve asks for one, comes
// from the form or from the address's #token= fragment (never sent in a URL), kept for the tab.
"use strict";
const POLL_MS = 1000;
const TOKEN_KEY = "ferry-token";

function take_token_from_fragment() {
  const m = location.hash.match(/token=([^&]+)/);
  if (m) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) tr.appendChild(c instanceof Node ? wrap(c) : el("td", c));
  return tr;
}

function wrap(node) {
  const td = document.createElement("td");
  td.appendChild(node);
  return td;
}

function fill(id, rows, empty) {
  const body = document.querySelector(`#${id} tbody`);
  if (!rows.length) {
    const td = el("td", empty, "muted");
    td.colSpan = document.querySelectorAll(`#${id} thead th`).length;
    rows = [document.createElement("tr")];
    rows[0].appendChild(td);
  }
  body.replaceChildren(...rows);
}

function when(epoch) {
  return epoch ? new Date(epoch * 1000).toLocaleTimeString() : "-";
}

function bar(ratio) {
  if (ratio === null || ratio === undefined) return el("span", "-", "muted");
  const span = el("span");
  const b = el("span", null, "bar");
  const i = el("i");
  i.style.width = `${Math.round(ratio * 100)}%`;
  b.appendChild(i);
  span.appendChild(b);
  span.appendChild(document.createTextNode(` ${Math.round(ratio * 100)}%`));
  span.dataset.ratio = String(ratio);
  return span;
}

function render(d) {
  fill("operations", d.operations.map(o => {
    const tr = row([o.kind, o.id, o.cluster, el("span", o.state, o.state === "failed" ? "bad" : ""),
      bar(o.progress), when(o.since), o.detail]);
    tr.dataset.kind = o.kind;
    tr.dataset.id = o.id;
    return tr;
  }), "no operation on record");
  fill("nodes", d.nodes.map(n => {
    const tr = row([n.cluster, n.node,
      el("span", n.available ? "available" : `unavailable: ${n.reason}`, n.available ? "ok" : "bad"),
      n.connections === null ? "-" : n.connections]);
    tr.dataset.node = n.node;
    tr.dataset.available = String(n.available);
    return tr;
  }), "no node");
  const relays = [];
  for (const r of d.relays) {
    const streams = r.streams.length ? r.streams : [{stream: "-"}];
    for (const s of streams) {
      relays.push(row([`${r.from} → ${r.to}${r.account ? ` (${r.account})` : ""}`, el("span", r.active ? "active" : "none", r.active ? "ok" : "bad"),
        s.stream, s.relayed ?? "-", s.lag ?? "-", s.lag_s ?? "-", s.rate ?? "-"]));
    }
  }
  fill("relays", relays, "no replication on record");
  fill("events", d.events.map(e => row([when(e.at), e.kind, e.id, `${e.was ?? "(new)"} → ${e.now ?? "(gone)"}`])),
    "no change seen since serve started");
  fill("audits", d.audits.map(a => {
    const link = el("a", a.name);
    link.href = a.html;
    link.addEventListener("click", open_report);
    const lost = Object.values(a.tiers).reduce((n, t) => n + t.lost, 0);
    const dup = Object.values(a.tiers).reduce((n, t) => n + t.duplicated, 0);
    return row([link, when(a.at), el("span", a.pass ? "pass" : "fail", a.pass ? "ok" : "bad"), a.sent, lost, dup]);
  }), "no audit report (serve --reports DIR)");
  const stale = d.journals.filter(j => j.read_age_s === null || j.read_age_s > 5).map(j => j.cluster);
  document.getElementById("status").textContent =
    `updated ${when(d.at)}` + (stale.length ? ` — journal not read lately: ${stale.join(", ")}` : "");
}

// a report needs the same token as the data: fetched with it, then shown from memory
async function open_report(ev) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) return;
  ev.preventDefault();
  const r = await fetch(ev.currentTarget.href, {headers: {Authorization: `Bearer ${token}`}});
  window.open(URL.createObjectURL(await r.blob()), "_blank");
}

async function poll() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  try {
    const r = await fetch("api/console", {headers: token ? {Authorization: `Bearer ${token}`} : {}});
    if (r.status === 401 || r.status === 403) {
      document.getElementById("login").hidden = false;
      document.getElementById("login-error").textContent = token ? "that token was refused" : "";
      document.getElementById("status").textContent = "a bearer token is needed";
      return;
    }
    document.getElementById("login").hidden = true;
    render(await r.json());
  } catch (e) {
    document.getElementById("status").textContent = `ferry serve is not answering (${e.message})`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

document.getElementById("login").addEventListener("submit", ev => {
  ev.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value);
});
take_token_from_fragment();
poll();
