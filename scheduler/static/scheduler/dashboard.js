// The live dashboard: renders what /ws/dashboard/ pushes and, for operators, sends their actions
// over the same socket. The job list (joblist.js) and the charts (charts.js) are their own files;
// this one holds the socket, the key figures, teams, executors, policy and features, and the
// editors: a value typed but not saved is marked as such and survives every push, and a refused
// save puts the server's reason in words beside its field.
"use strict";

(() => {
  const { $, node, button, fill, cap, pct } = Tm;

  let socket = null;
  let state = null;
  let sequence = 0;
  const drafts = new Map(); // editor key -> what the operator typed and has not saved yet
  const errors = new Map(); // editor key -> why the server refused it, in words
  const editors = new Map(); // editor key -> {wrap, input, error, server}, kept across pushes
  const pending = new Map(); // request id -> {label, keys, fields, done}

  // What became of the last action. Successes fade after a while; a refusal stays until the next.
  let fading = null;
  function notice(text, kind) {
    clearTimeout(fading);
    $("notice").textContent = text;
    $("notice").className = kind || "";
    if (kind === "ok") fading = setTimeout(() => notice(""), 8000);
  }

  // --- the socket ------------------------------------------------------------------------------

  // Send an action; `keys` are the editors it saves (cleared when it succeeds), `fields` maps a
  // field the server may name in its refusal to the editor that shows it.
  function send(action, fields, label, keys = [], fieldKeys = {}) {
    if (!socket || socket.readyState !== WebSocket.OPEN) {
      notice(`${label}: not connected; try again in a moment`, "error");
      return;
    }
    const id = ++sequence;
    pending.set(id, { label, keys, fields: fieldKeys });
    for (const key of keys) errors.delete(key);
    socket.send(JSON.stringify({ id, action, ...fields }));
    notice(`${label}…`);
    refreshEditors();
  }

  // Ask for another page or filter of jobs (joblist.js); `done` hears the reply.
  function sendView(view, done) {
    if (!socket || socket.readyState !== WebSocket.OPEN) return false;
    const id = ++sequence;
    pending.set(id, { label: "job list", keys: [], fields: {}, done });
    socket.send(JSON.stringify({ id, view }));
    return true;
  }

  function replied(reply) {
    const request = pending.get(reply.reply);
    pending.delete(reply.reply);
    if (request && request.done) {
      request.done(reply);
      return;
    }
    const label = request ? request.label : "action";
    if (reply.ok) {
      if (request) for (const key of request.keys) { drafts.delete(key); errors.delete(key); }
      notice(`${label}: done`, "ok");
      refreshEditors();
      return;
    }
    const error = reply.error || {};
    const unplaced = {};
    for (const [name, messages] of Object.entries(error.fields || {})) {
      const key = (request && request.fields[name]) || (request && request.keys.length === 1 ? request.keys[0] : null);
      if (key && editors.has(key)) errors.set(key, Tm.words(messages));
      else unplaced[name] = messages;
    }
    const why = Object.keys(unplaced).length ? Tm.words(unplaced)
      : error.fields ? "see the field marked below" : (error.detail || error.error || "refused");
    notice(`${label}: not saved: ${why}`, "error");
    refreshEditors();
  }

  // --- editors: inputs kept across pushes ------------------------------------------------------

  const shownValue = (v) => (v === null || v === undefined ? "" : typeof v === "object" ? JSON.stringify(v) : String(v));

  // An editable value: its input (the same element on every push), a mark while it holds an unsaved
  // edit, and the server's refusal in words. `make` builds the input once; `extra` (a Save button)
  // sits beside it. Escape puts the saved value back.
  function editor(key, serverValue, make, extra = [], block = false) {
    let ed = editors.get(key);
    if (!ed) {
      const input = make();
      input.dataset.key = key;
      const error = node("span", { className: "field-error", role: "alert" });
      const mark = node("span", { className: "mark", text: "unsaved", title: "Typed but not saved (Esc puts the saved value back)" });
      const line = node("span", { className: "line" }, [input, ...extra, mark]);
      const wrap = node("span", { className: block ? "edit block" : "edit" }, [line, error]);
      ed = { key, wrap, input, error, server: serverValue };
      const remember = () => {
        drafts.set(key, input.value);
        errors.delete(key);
        sync(ed);
        if (state && key.startsWith("policy:")) renderPolicyActions(state);
      };
      input.addEventListener(input.tagName === "SELECT" ? "change" : "input", remember);
      input.addEventListener("keydown", (event) => {
        if (event.key !== "Escape") return;
        drafts.delete(key);
        errors.delete(key);
        input.value = shownValue(ed.server);
        sync(ed);
      });
      editors.set(key, ed);
    }
    ed.server = serverValue;
    ed.seen = true;
    sync(ed);
    return ed.wrap;
  }

  function sync(ed) {
    const { input, key } = ed;
    const server = shownValue(ed.server);
    if (!drafts.has(key) && input !== document.activeElement && input.value !== server) input.value = server;
    const dirty = drafts.has(key) && drafts.get(key) !== server;
    ed.wrap.classList.toggle("dirty", dirty);
    ed.wrap.classList.toggle("invalid", errors.has(key));
    ed.error.textContent = errors.get(key) || "";
    input.setAttribute("aria-invalid", errors.has(key) ? "true" : "false");
  }

  function refreshEditors() {
    for (const ed of editors.values()) sync(ed);
    if (state) renderPolicyActions(state);
  }

  const numberInput = (label, props = {}) => () => node("input", { type: "number", step: "any", "aria-label": label, ...props });

  function number(key, fallback) {
    const raw = drafts.has(key) ? drafts.get(key) : fallback;
    return raw === "" ? NaN : Number(raw);
  }

  // --- key figures -----------------------------------------------------------------------------

  function kpi(id, value, sub, cls) {
    const tile = $(id);
    tile.querySelector(".value").textContent = value;
    const subline = tile.querySelector(".sub");
    if (subline && sub !== undefined && subline.id !== "global") subline.textContent = sub;
    tile.className = `kpi ${cls || ""}`;
  }

  function renderKpis(s) {
    const q = s.queue;
    const g = q.global;
    const full = g.cap !== null && g.in_use >= g.cap;
    kpi("kpi-slots", cap(g.in_use, g.cap), undefined, full ? "full" : "");
    $("global").textContent = g.cap === null ? "no global cap" : full ? "at the global cap" : `${g.cap - g.in_use} free under the global cap`;
    const running = q.teams.reduce((n, t) => n + t.running, 0);
    const queued = q.teams.reduce((n, t) => n + t.queued, 0);
    const busy = q.teams.filter((t) => t.running || t.queued).length;
    kpi("kpi-running", Tm.int(running), `${busy} of ${q.teams.length} team${q.teams.length === 1 ? "" : "s"} busy`);
    const blocked = q.teams.filter((t) => t.queued && t.not_served.length).length;
    kpi("kpi-queued", Tm.int(queued), blocked ? `${blocked} team${blocked === 1 ? "" : "s"} blocked` : "none blocked",
      blocked ? "warn" : "");
    const usable = q.executors.filter((e) => e.enabled && e.health !== "down" && e.breaker !== "open").length;
    const inUse = q.executors.reduce((n, e) => n + e.in_use, 0);
    const limit = q.executors.reduce((n, e) => n + (e.enabled ? e.limit : 0), 0);
    kpi("kpi-executors", `${usable} / ${q.executors.length} up`, `${inUse} of ${limit} slots busy`,
      usable < q.executors.length ? "warn" : "");
  }

  // --- teams and users -------------------------------------------------------------------------

  // A team's retention in force: finished jobs, and their prompts and answers when sooner.
  const hours = (h) => `${Number(h).toLocaleString("en-US", { maximumFractionDigits: 2 })} h`;
  function kept(t) {
    return hours(t.retention_hours) + (t.body_retention_hours === null ? "" : ` · bodies ${hours(t.body_retention_hours)}`);
  }

  // What retention keeps in bounds (operators): the deployment's settings, rows per table.
  function renderRetention(r) {
    const line = $("retention");
    line.hidden = !r;
    if (!r) return;
    const tables = Object.entries(r.tables).map(([name, n]) => `${name} ~${Tm.int(n)}`).join(", ");
    line.textContent = `Retention: finished jobs ${hours(r.hours)}, audit ${Tm.int(r.audit_days)} days. Rows: ${tables}.`;
  }

  function renderTeams(q, operator) {
    const headers = ["team", ["queued", "num"], ["running", "num"], ["slots", "num"], "weight", ["target share", "num"],
      ["actual share", "num"], "waits because", "kept"];
    fill($("teams"), headers, q.teams.map((t) => {
      let weight = [t.weight, "num"];
      if (operator) {
        const key = `weight:${t.team}`;
        const save = button("Save", () => {
          const value = number(key, t.weight);
          const weights = { ...state.policy.team_weights, [t.team]: value };
          send("policy.update", { changes: { team_weights: weights } }, `weight of ${t.team}`, [key], { team_weights: key });
        }, { "aria-label": `save weight of ${t.team}` });
        weight = [editor(key, t.weight, numberInput(`weight of ${t.team}`, { min: "0" }), [save])];
      }
      const idle = !t.queued && !t.running;
      const target = idle
        ? [`idle · ${pct(t.share_if_busy)} if busy`, "num muted"]
        : [pct(t.target_share), "num"];
      const full = t.cap !== null && t.in_use >= t.cap;
      return [[t.team], [Tm.int(t.queued), "num"], [Tm.int(t.running), "num"], [cap(t.in_use, t.cap), full ? "num full" : "num"],
        weight, target, [pct(t.actual_share), "num"], [t.not_served.join("; "), "wrap"], [kept(t), "muted"]];
    }), "no teams");
    fill($("users"), ["user", ["slots", "num"]],
      q.users.map((u) => [[u.user], [cap(u.in_use, u.cap), u.cap !== null && u.in_use >= u.cap ? "num full" : "num"]]),
      "no one holds a slot or has a cap");
    // Apps' API keys of the teams shown, read-only (made and revoked through /api/keys/ or the admin).
    fill($("keys"), ["key", "name", "team", "models", ["slots", "num"], "last used"],
      (q.keys || []).map((k) => [[`${k.prefix}…`], [k.name], [k.team], [k.models.join(", ") || "all", "wrap"],
        [cap(k.in_use, k.cap), k.cap !== null && k.in_use >= k.cap ? "num full" : "num"], [k.last_used_at || "never"]]),
      "no API keys");
    // Batches under way (docs/batches.md): each one's requests answered, failed and in the queue.
    fill($("batches"), ["batch", "team", "status", ["done", "num"], ["failed", "num"], ["queued or running", "num"],
      ["total", "num"]],
      (q.batches || []).map((b) => [[b.id], [b.team], [b.status], [b.completed, "num"], [b.failed, "num"],
        [b.running, "num"], [b.total, "num"]]),
      "no batch under way");
  }

  // --- executors -------------------------------------------------------------------------------

  function renderExecutors(q, operator) {
    const headers = ["executor", "kind", "team", "models", ["slots", "num"], "", "health", "breaker", "enabled", "capacity"];
    fill($("executors"), headers, q.executors.map((e) => {
      let enabled = [e.enabled ? "yes" : "no", e.enabled ? "" : "down"];
      let capacity = [e.max_concurrency, "num"];
      if (operator) {
        enabled = [node("input", {
          type: "checkbox", checked: e.enabled, "aria-label": `enabled ${e.name}`,
          on: { change: (event) => send("executor.update", { executor: e.id, changes: { enabled: event.target.checked } },
            `${e.name} ${event.target.checked ? "enabled" : "disabled"}`) },
        })];
        const key = `capacity:${e.id}`;
        const save = button("Save", () => send("executor.update",
          { executor: e.id, changes: { max_concurrency: number(key, e.max_concurrency) } },
          `capacity of ${e.name}`, [key], { max_concurrency: key }), { "aria-label": `save capacity of ${e.name}` });
        capacity = [editor(key, e.max_concurrency, numberInput(`capacity of ${e.name}`, { min: "0", step: "1" }), [save])];
      }
      const full = e.in_use >= e.limit;
      return [[e.name], [e.kind], [e.team || "shared"], [e.models.join(", ")], [cap(e.in_use, e.limit), full ? "num full" : "num"],
        [Tm.meter(e.in_use, e.limit)], [Tm.pill(e.health)], [Tm.pill(e.breaker.replace("_", " "), e.breaker)], enabled, capacity];
    }), "no executors");
  }

  // Model routes, read-only (edited through /api/routes/ or the admin): docs/routing.md.
  function renderRoutes(q) {
    fill($("routes"), ["route", "models, in order"],
      (q.routes || []).map((r) => [[r.name], [r.models.join(" → "), "wrap"]]), "no model routes");
  }

  // --- policy ----------------------------------------------------------------------------------

  // What each setting does (the model's help_text, as the admin shows it), from the page itself
  // (scheduler/views.py): it never changes while the page is open, so no push carries it.
  const POLICY_HELP = JSON.parse($("policy").dataset.help);
  const settingCells = new Map(); // setting -> its name and help, kept across pushes

  function settingCell(name) {
    if (!settingCells.has(name)) {
      settingCells.set(name, [node("span", { className: "setting", text: name }),
        node("span", { className: "help", id: `help-${name}`, text: POLICY_HELP[name] || "" })]);
    }
    return settingCells.get(name);
  }

  function renderPolicy(s, operator) {
    const names = Object.keys(s.policy).sort();
    fill($("policy"), ["setting", "value"], names.map((name) => {
      const value = s.policy[name];
      if (!operator) return [[settingCell(name), "wrap"], [shownValue(value), "wrap"]];
      const key = `policy:${name}`;
      const described = { "aria-label": name, "aria-describedby": `help-${name}` };
      let make;
      let block = false;
      if (s.policy_choices[name]) {
        make = () => node("select", described, s.policy_choices[name].map((c) => node("option", { value: c, text: c })));
      } else if (typeof value === "number") {
        make = numberInput(name, { "aria-describedby": `help-${name}` });
      } else if (typeof value === "object") {
        make = () => node("textarea", { ...described, spellcheck: false });
        block = true;
      } else {
        make = () => node("input", { type: "text", ...described });
      }
      return [[settingCell(name), "wrap"], [editor(key, value, make, [], block), block ? "wrap" : ""]];
    }));
    renderPolicyActions(s);
  }

  let saveButton = null;
  function renderPolicyActions(s) {
    const actions = $("policy-actions");
    if (!s.operator) { actions.replaceChildren(); return; }
    const unsaved = Object.keys(s.policy).filter((name) => {
      const key = `policy:${name}`;
      return drafts.has(key) && drafts.get(key) !== shownValue(s.policy[name]);
    });
    if (!saveButton) saveButton = button("Save policy", savePolicy, { "aria-label": "save queue policy", className: "primary" });
    const note = node("span", { className: "unsaved", text: unsaved.length
      ? `${unsaved.length} unsaved change${unsaved.length === 1 ? "" : "s"}: ${unsaved.join(", ")} (Esc in a field undoes it)` : "" });
    if (actions.firstChild !== saveButton) actions.replaceChildren(saveButton, note);
    else actions.replaceChild(note, actions.childNodes[1]);
  }

  function savePolicy() {
    const s = state;
    const changes = {};
    const keys = [];
    const fieldKeys = {};
    for (const name of Object.keys(s.policy)) {
      const key = `policy:${name}`;
      if (!drafts.has(key)) continue;
      const current = s.policy[name];
      let value = drafts.get(key);
      if (typeof current === "number") value = value === "" ? null : Number(value);
      else if (typeof current === "object" && current !== null) {
        try {
          value = JSON.parse(value);
        } catch (error) {
          errors.set(key, `Not valid JSON: ${error.message}.`);
          refreshEditors();
          notice(`queue policy: not saved: ${name} is not valid JSON`, "error");
          return;
        }
      }
      changes[name] = value;
      keys.push(key);
      fieldKeys[name] = key;
    }
    if (!keys.length) { notice("queue policy: nothing changed"); return; }
    send("policy.update", { changes }, "queue policy", keys, fieldKeys);
  }

  // --- features --------------------------------------------------------------------------------

  function renderFeatures(s, operator) {
    const f = s.features;
    const teams = Object.keys(f.teams);
    fill($("features"), ["feature", "everyone", ...teams], f.features.map((feature) => {
      let global = [Tm.pill(f.global[feature] ? "on" : "off", f.global[feature] ? "ok" : "down")];
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
        if (!operator) return [Tm.pill(effective ? "on" : "off", effective ? "ok" : "down")];
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

  // --- everything ------------------------------------------------------------------------------

  function render(s) {
    state = s;
    for (const ed of editors.values()) ed.seen = false;
    renderKpis(s);
    renderTeams(s.queue, s.operator);
    renderRetention(s.retention);
    renderExecutors(s.queue, s.operator);
    renderRoutes(s.queue);
    Tm.jobs.render(s);
    renderPolicy(s, s.operator);
    renderFeatures(s, s.operator);
    for (const [key, ed] of editors) if (!ed.seen && !ed.wrap.isConnected) editors.delete(key);
    Tm.charts.live(s);
  }

  let retry = 500;
  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(`${scheme}://${location.host}/ws/dashboard/`);
    socket.addEventListener("open", () => {
      retry = 500;
      Tm.jobs.reconnected();
    });
    socket.addEventListener("message", (message) => {
      const update = JSON.parse(message.data);
      if (update.reply !== undefined) {
        replied(update);
        return;
      }
      Tm.skew = Date.parse(update.at) - Date.now();
      if (update.state) render(update.state);
      else if (state) {
        Tm.jobs.tick(state);
        Tm.charts.tick();
      }
      $("status").textContent = `live · updated ${Tm.time(update.at)}`;
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

  Tm.send = send;
  Tm.sendView = sendView;
  Tm.notice = notice;
  Tm.kpi = kpi;
  Tm.charts.start();
  connect();
})();
