// Shared by the dashboard's scripts (charts.js, joblist.js, dashboard.js): building elements, filling
// tables in place, and putting numbers, times and errors into words. Static files only (no inline
// script), so the page's Content-Security-Policy can forbid inline code. Everything is built with
// textContent: slugs, usernames, models and errors come from users.
"use strict";

const Tm = (window.Tm = {});

Tm.$ = (id) => document.getElementById(id);

Tm.node = function node(tag, props = {}, children = []) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (value === undefined) continue;
    if (name === "text") element.textContent = value;
    else if (name === "on") for (const [event, fn] of Object.entries(value)) element.addEventListener(event, fn);
    else if (name === "dataset") Object.assign(element.dataset, value);
    else if (name in element && name !== "list" && !name.includes("-")) element[name] = value;
    else element.setAttribute(name, value);
  }
  for (const child of children) if (child !== null && child !== undefined) element.append(child);
  return element;
};

Tm.button = (label, onClick, props = {}) => Tm.node("button", { type: "button", text: label, on: { click: onClick }, ...props });

// --- words for numbers, times and durations --------------------------------------------------

Tm.cap = (inUse, limit) => (limit === null || limit === undefined ? `${inUse} / ∞` : `${inUse} / ${limit}`);
Tm.pct = (x) => `${(100 * x).toFixed(1)}%`;
Tm.time = (iso) => (iso ? new Date(iso).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hourCycle: "h23" }) : "");
Tm.stamp = (iso) => (iso ? new Date(iso).toLocaleString([], { dateStyle: "medium", timeStyle: "medium", hourCycle: "h23" }) : "");
Tm.int = (n) => (n === null || n === undefined ? "" : Math.round(n).toLocaleString("en-US"));

// 0.84 s, 12 s, 4 m 05 s, 2 h 10 m, 3 d 4 h
Tm.duration = function duration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "";
  const s = Math.max(seconds, 0);
  if (s === 0) return "0 s";
  if (s < 10) return `${s.toFixed(s < 1 ? 2 : 1)} s`;
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} m ${String(Math.floor(s % 60)).padStart(2, "0")} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} m`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
};

// A period in words: "3 s", "minute", "4 minutes", "hour" (for "a point every ...").
Tm.every = function every(seconds) {
  if (seconds % 3600 === 0) return seconds === 3600 ? "hour" : `${seconds / 3600} hours`;
  if (seconds % 60 === 0) return seconds === 60 ? "minute" : `${seconds / 60} minutes`;
  return `${seconds} s`;
};

// 12, 1.2k, 34k, 1.2M
Tm.short = function short(n) {
  if (n === null || n === undefined) return "";
  const a = Math.abs(n);
  if (a >= 1e6) return `${(n / 1e6).toFixed(a >= 1e7 ? 0 : 1)}M`;
  if (a >= 1e3) return `${(n / 1e3).toFixed(a >= 1e4 ? 0 : 1)}k`;
  return String(Math.round(n * 100) / 100);
};

// Money (jobs' cost, spend), the one way the charts and the tiles both show it: two decimals, or as
// many more as two significant digits of a small amount need (0.0004, 0.000052), up to eight.
Tm.money = function money(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "";
  const a = Math.abs(v);
  const places = a > 0 && a < 0.1 ? Math.min(1 - Math.floor(Math.log10(a)), 8) : 2;
  return v.toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: places });
};

// The server's clock, as the last push stamped it: durations of running work use it, not the
// browser's clock, which may be minutes off.
Tm.skew = 0;
Tm.now = () => Date.now() + Tm.skew;
Tm.since = (iso, until) => (iso ? ((until ? Date.parse(until) : Tm.now()) - Date.parse(iso)) / 1000 : null);

// --- errors in words -------------------------------------------------------------------------

// A field's messages as the API returns them (["msg"], {"key": ["msg"]}, [{"key": ["msg"]}, ...])
// put into one sentence or a few: never JSON on the page.
Tm.words = function words(messages) {
  if (messages === null || messages === undefined) return "";
  if (typeof messages === "string") return messages;
  if (Array.isArray(messages)) {
    return messages.map((m, i) => (typeof m === "object" && m !== null && !Array.isArray(m)
      ? (Object.keys(m).length ? `item ${i + 1}: ${Tm.words(m)}` : "") : Tm.words(m))).filter(Boolean).join(" ");
  }
  return Object.entries(messages).map(([name, m]) => `${name}: ${Tm.words(m)}`).join("; ");
};

// --- tables, filled in place -----------------------------------------------------------------

function sameContent(cell, content) {
  const nodes = Array.isArray(content) ? content : [content];
  if (cell.childNodes.length !== nodes.length) return false;
  return nodes.every((n, i) => n instanceof Node && cell.childNodes[i] === n);
}

function headerCell(h) {
  const [text, cls] = Array.isArray(h) ? h : [h, ""];
  return Tm.node("th", { text, className: cls || "" });
}

// Rows are updated in place, cell by cell. A cell whose content is the element it already holds
// (an editor kept across pushes, see dashboard.js) is left alone, so a push never takes the focus,
// caret, selection or half-typed value of a field being edited.
Tm.fill = function fill(table, headers, rows, empty = "none") {
  const heading = headers.map((h) => (Array.isArray(h) ? h[0] : h)).join("\u0000");
  if (!table.rows.length || table.dataset.heading !== heading) {
    table.replaceChildren();
    const head = table.createTHead().insertRow();
    for (const h of headers) head.appendChild(headerCell(h));
    table.dataset.heading = heading;
  }
  const body = table.tBodies[0] || table.createTBody();
  while (body.rows.length > Math.max(rows.length, 1)) body.deleteRow(-1);
  if (!rows.length) {
    if (body.rows.length && body.rows[0].cells[0].colSpan === headers.length && body.rows[0].cells[0].classList.contains("muted")) {
      body.rows[0].cells[0].textContent = empty;
      return;
    }
    body.replaceChildren();
    const cell = body.insertRow().insertCell();
    cell.colSpan = headers.length;
    cell.className = "muted";
    cell.textContent = empty;
    return;
  }
  rows.forEach((row, index) => {
    const { cells, rowClass, rowKey } = Array.isArray(row) ? { cells: row } : row;
    let tr = body.rows[index];
    if (!tr || tr.cells.length !== cells.length || tr.cells[0].colSpan !== 1) {
      if (tr) tr.remove();
      tr = body.insertRow(index);
      for (let i = 0; i < cells.length; i++) tr.insertCell();
    }
    tr.className = rowClass || "";
    if (rowKey !== undefined) tr.dataset.key = rowKey;
    cells.forEach(([content, cls], i) => {
      const td = tr.cells[i];
      if (td.className !== (cls || "")) td.className = cls || "";
      if (content instanceof Node || Array.isArray(content)) {
        if (sameContent(td, content)) return;
        if (Array.isArray(content)) td.replaceChildren(...content.filter((c) => c !== null && c !== undefined));
        else td.replaceChildren(content);
        return;
      }
      const text = content === null || content === undefined ? "" : String(content);
      if (td.childNodes.length !== 1 || td.firstChild.nodeType !== Node.TEXT_NODE || td.textContent !== text) td.textContent = text;
    });
  });
};

Tm.pill = (text, cls) => Tm.node("span", { className: `pill ${cls || text}`, text });

Tm.meter = (inUse, limit) => {
  const bar = Tm.node("span");
  const full = limit !== null && limit !== undefined && inUse >= limit;
  bar.style.width = limit ? `${Math.min(100, (100 * inUse) / limit)}%` : inUse ? "100%" : "0%";
  return Tm.node("span", { className: full ? "meter full" : "meter", "aria-hidden": "true" }, [bar]);
};
