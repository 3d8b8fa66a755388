// The live dashboard: renders what /ws/dashboard/ pushes and, for operators, sends their actions
// over the same socket. A static file (no inline script), so a Content-Security-Policy can forbid
// inline code. Everything is built with textContent: slugs, usernames and errors come from users.
"use strict";

const $ = (id) => document.getElementById(id);
const cap = (inUse, limit) => (limit === null || limit === undefined ? `${inUse} / ∞` : `${inUse} / ${limit}`);
const pct = (x) => `${(100 * x).toFixed(1)}%`;
const time = (iso) => (iso ? new Date(iso).toLocaleTimeString() : "");

let socket = null;
let state = null;
let sequence = 0;
const drafts = new Map(); // input key -> what the operator typed and has not saved yet
const pending = new Map(); // request id -> {label, keys}

function node(tag, props = {}, children = []) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "text") element.textContent = value;
    else if (name === "on") for (const [event, fn] of Object.entries(value)) element.addEventListener(event, fn);
    else if (name in element && name !== "list") element[name] = value;
    else element.setAttribute(name, value);
  }
  for (const child of children) element.append(child);
  return element;
}

// An input whose unsaved value survives the re-renders that each update causes.
function field(key, value, props = {}) {
  const { multiline, ...rest } = props;
  const shown = drafts.has(key) ? drafts.get(key) : value;
  const element = node(multiline ? "textarea" : "input", rest);
  element.dataset.key = key;
  element.value = shown === null || shown === undefined ? "" : String(shown);
  element.addEventListener("input", () => drafts.set(key, element.value));
  return element;
}

function button(label, onClick, props = {}) {
  return node("button", { type: "button", text: label, on: { click: onClick }, ...props });
}

// The key of the editable field among a cell's content (an input, a select, or [input, button]).
function keyOf(content) {
  const nodes = Array.isArray(content) ? content : [content];
  const found = nodes.find((n) => n instanceof Element && n.dataset.key);
  return found ? found.dataset.key : null;
}

// A field the operator is using: focused, or holding what they typed and have not saved.
function editing(cell, key) {
  const current = key && cell.querySelector(`[data-key="${CSS.escape(key)}"]`);
  return Boolean(current) && (current === document.activeElement || drafts.has(key));
}

// Rows are updated in place, cell by cell: a cell whose field is being edited is left as it is, so
// a pushed update never takes its focus, caret, selection or half-typed value (a number input's
// "-" or "1e" reads as "" and could not be put back).
function fill(table, headers, rows) {
  const heading = headers.join("\u0000");
  if (!table.rows.length || table.dataset.heading !== heading) {
    table.replaceChildren();
    const head = table.insertRow();
    for (const h of headers) head.appendChild(node("th", { text: h }));
    table.dataset.heading = heading;
  }
  while (table.rows.length > rows.length + 1) table.deleteRow(-1);
  if (!rows.length) {
    const cell = table.insertRow().insertCell();
    cell.colSpan = headers.length;
    cell.className = "muted";
    cell.textContent = "none";
    return;
  }
  rows.forEach((row, index) => {
    let tr = table.rows[index + 1];
    if (!tr || tr.cells.length !== row.length || tr.cells[0].colSpan !== 1) {
      if (tr) tr.remove();
      tr = table.insertRow(index + 1);
      for (let i = 0; i < row.length; i++) tr.insertCell();
    }
    row.forEach(([content, cls], i) => {
      const td = tr.cells[i];
      td.className = cls || "";
      if (editing(td, keyOf(content))) return;
      if (content instanceof Node) td.replaceChildren(content);
      else if (Array.isArray(content)) td.replaceChildren(...content);
      else td.textContent = content === null || content === undefined ? "" : String(content);
    });
  });
}

function notice(text, kind) {
  $("notice").textContent = text;
  $("notice").className = kind || "";
}

function send(action, fields, label, keys = []) {
  if (!socket || socket.readyState !== WebSocket.OPEN) {
    notice(`${label}: not connected; try again in a moment`, "error");
    return;
  }
  const id = ++sequence;
  pending.set(id, { label, keys });
  socket.send(JSON.stringify({ id, action, ...fields }));
  notice(`${label}…`);
}

function replied(reply) {
  const request = pending.get(reply.reply);
  pending.delete(reply.reply);
  const label = request ? request.label : "action";
  if (reply.ok) {
    if (request) for (const key of request.keys) drafts.delete(key);
    notice(`${label}: done`, "ok");
    return;
  }
  const error = reply.error || {};
  const fields = error.fields ? ` ${JSON.stringify(error.fields)}` : "";
  notice(`${label}: ${error.detail || error.error || "refused"}${fields}`, "error");
}

function number(key, fallback) {
  const raw = drafts.has(key) ? drafts.get(key) : fallback;
  return raw === "" ? NaN : Number(raw);
}

// --- sections ---------------------------------------------------------------------------------

function renderTeams(q, operator) {
  const g = q.global;
  $("global").textContent = `global: ${cap(g.in_use, g.cap)} slots in use`;
  $("global").className = g.cap !== null && g.in_use >= g.cap ? "full" : "";
  fill($("teams"), ["team", "queued", "running", "slots", "weight", "target share", "actual share", "waits because"],
    q.teams.map((t) => {
      let weight = [t.weight, "num"];
      if (operator) {
        const key = `weight:${t.team}`;
        weight = [[
          field(key, t.weight, { type: "number", min: "0", step: "any", "aria-label": `weight of ${t.team}` }),
          button("Save", () => {
            const value = number(key, t.weight);
            const weights = { ...state.policy.team_weights, [t.team]: value };
            send("policy.update", { changes: { team_weights: weights } }, `weight of ${t.team}`, [key]);
          }, { "aria-label": `save weight of ${t.team}` }),
        ]];
      }
      return [[t.team], [t.queued, "num"], [t.running, "num"],
        [cap(t.in_use, t.cap), t.cap !== null && t.in_use >= t.cap ? "num full" : "num"], weight,
        [pct(t.target_share), "num"], [pct(t.actual_share), "num"], [t.not_served.join("; "), "wrap"]];
    }));
  fill($("users"), ["user", "slots"],
    q.users.map((u) => [[u.user], [cap(u.in_use, u.cap), u.cap !== null && u.in_use >= u.cap ? "num full" : "num"]]));
}

function renderExecutors(q, operator) {
  fill($("executors"), ["executor", "kind", "team", "models", "slots", "health", "breaker", "enabled", "capacity"],
    q.executors.map((e) => {
      let enabled = [e.enabled ? "yes" : "no"];
      let capacity = [e.max_concurrency, "num"];
      if (operator) {
        enabled = [node("input", {
          type: "checkbox", checked: e.enabled, "aria-label": `enabled ${e.name}`,
          on: { change: (event) => send("executor.update", { executor: e.id, changes: { enabled: event.target.checked } },
            `${e.name} ${event.target.checked ? "enabled" : "disabled"}`) },
        })];
        const key = `capacity:${e.id}`;
        capacity = [[
          field(key, e.max_concurrency, { type: "number", min: "0", step: "1", "aria-label": `capacity of ${e.name}` }),
          button("Save", () => send("executor.update",
            { executor: e.id, changes: { max_concurrency: number(key, e.max_concurrency) } },
            `capacity of ${e.name}`, [key]), { "aria-label": `save capacity of ${e.name}` }),
        ]];
      }
      return [[e.name], [e.kind], [e.team || "shared"], [e.models.join(", ")], [cap(e.in_use, e.limit), "num"],
        [e.health, e.health], [e.breaker, e.breaker], enabled, capacity];
    }));
}

function renderJobs(s, operator) {
  const shown = s.jobs.length;
  const count = $("jobs-count");
  count.replaceChildren(`showing ${shown} of ${s.jobs_total} job${s.jobs_total === 1 ? "" : "s"} · `,
    node("a", { href: s.jobs_link, text: "all jobs" }));
  const headers = ["id", "team", "user", "type", "model", "priority", "status", "round", "executor", "attempts", "tokens",
    "submitted", "started", "finished", "waits because", "error"];
  if (operator) headers.push("");
  fill($("jobs"), headers, s.jobs.map((j) => {
    const row = [[node("a", { href: j.link, text: String(j.id) }), "num"], [j.team], [j.user], [j.type], [j.model],
      [j.priority, "num"], [j.status, j.status], [j.round_label], [j.executor], [j.attempts, "num"], [j.tokens_used, "num"],
      [time(j.submitted_at)], [time(j.started_at)], [time(j.finished_at)], [j.waits.join("; "), "wrap"],
      [j.error, "wrap"]];
    if (operator) {
      const actions = [];
      if (j.status === "queued" || j.status === "running") {
        actions.push(button("Cancel", () => send("job.cancel", { job: j.id }, `cancel job ${j.id}`),
          { "aria-label": `cancel job ${j.id}` }));
      }
      if (j.status === "failed" || j.status === "canceled") {
        actions.push(button("Requeue", () => send("job.requeue", { job: j.id }, `requeue job ${j.id}`),
          { "aria-label": `requeue job ${j.id}` }));
      }
      row.push([actions]);
    }
    return row;
  }));
}

function renderPolicy(s, operator) {
  const names = Object.keys(s.policy).sort();
  fill($("policy"), ["setting", "value"], names.map((name) => {
    const value = s.policy[name];
    const shown = typeof value === "object" && value !== null ? JSON.stringify(value) : value;
    if (!operator) return [[name], [shown, "wrap"]];
    const key = `policy:${name}`;
    let input;
    if (s.policy_choices[name]) {
      input = node("select", { "aria-label": name }, s.policy_choices[name].map((c) => node("option", { value: c, text: c })));
      input.value = drafts.has(key) ? drafts.get(key) : value;
      input.dataset.key = key;
      input.addEventListener("change", () => drafts.set(key, input.value));
    } else if (typeof value === "number") {
      input = field(key, value, { type: "number", step: "any", "aria-label": name });
    } else if (typeof value === "object") {
      input = field(key, shown, { multiline: true, "aria-label": name });
    } else {
      input = field(key, value, { type: "text", "aria-label": name });
    }
    return [[name], [input]];
  }));
  const actions = $("policy-actions");
  actions.replaceChildren();
  if (operator) {
    actions.append(button("Save policy", () => {
      const changes = {};
      const keys = [];
      for (const name of names) {
        const key = `policy:${name}`;
        if (!drafts.has(key)) continue;
        const current = s.policy[name];
        let value = drafts.get(key);
        try {
          if (typeof current === "number") value = Number(value);
          else if (typeof current === "object" && current !== null) value = JSON.parse(value);
        } catch (error) {
          notice(`${name}: not valid JSON (${error.message})`, "error");
          return;
        }
        changes[name] = value;
        keys.push(key);
      }
      if (!keys.length) { notice("nothing changed"); return; }
      send("policy.update", { changes }, "queue policy", keys);
    }, { "aria-label": "save queue policy" }));
  }
}

function renderFeatures(s, operator) {
  const f = s.features;
  const teams = Object.keys(f.teams);
  fill($("features"), ["feature", "everyone", ...teams], f.features.map((feature) => {
    let global = [f.global[feature] ? "on" : "off", f.global[feature] ? "ok" : "down"];
    if (operator) {
      global = [node("input", {
        type: "checkbox", checked: f.global[feature], "aria-label": `${feature} for everyone`,
        on: { change: (event) => send("feature.set", { changes: { feature, team: null, enabled: event.target.checked } },
          `${feature} for everyone`) },
      })];
    }
    const cells = teams.map((team) => {
      const own = f.teams[team].switches[feature];
      const effective = f.teams[team].effective[feature];
      if (!operator) return [effective ? "on" : "off", effective ? "ok" : "down"];
      const select = node("select", { "aria-label": `${feature} for ${team}` }, [
        node("option", { value: "", text: `as everyone (${f.global[feature] ? "on" : "off"})` }),
        node("option", { value: "on", text: "on" }), node("option", { value: "off", text: "off" }),
      ]);
      select.value = own === null ? "" : own ? "on" : "off";
      select.addEventListener("change", () => send("feature.set",
        { changes: { feature, team, enabled: select.value === "" ? null : select.value === "on" } },
        `${feature} for ${team}`));
      return [select];
    });
    return [[feature], global, ...cells];
  }));
}

function render(s) {
  state = s;
  const focused = document.activeElement && document.activeElement.dataset ? document.activeElement.dataset.key : null;
  renderTeams(s.queue, s.operator);
  renderExecutors(s.queue, s.operator);
  renderJobs(s, s.operator);
  renderPolicy(s, s.operator);
  renderFeatures(s, s.operator);
  if (focused) {
    const again = document.querySelector(`[data-key="${CSS.escape(focused)}"]`);
    if (again) again.focus();
  }
}

let retry = 500;
function connect() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  socket = new WebSocket(`${scheme}://${location.host}/ws/dashboard/`);
  socket.addEventListener("open", () => { retry = 500; });
  socket.addEventListener("message", (message) => {
    const update = JSON.parse(message.data);
    if (update.reply !== undefined) {
      replied(update);
      return;
    }
    if (update.state) render(update.state);
    $("status").textContent = `live · updated ${time(update.at)}`;
    $("status").className = "";
    document.body.dataset.updated = update.at;
  });
  socket.addEventListener("close", () => {
    $("status").textContent = "disconnected · reconnecting…";
    $("status").className = "down";
    setTimeout(connect, retry);
    retry = Math.min(retry * 2, 10000);
  });
}

connect();
