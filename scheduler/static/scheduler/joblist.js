// The dashboard's job list: tabs by status (running first everywhere), filters, pages through every
// job the user may see (the server pages, scheduler/live/joblist.py: the page asks over the socket
// and each push carries that page), and a job's details (fields, rounds, events, input, result)
// in a drawer, read from the REST API with the page's session.
"use strict";

(() => {
  const { $, node, button, fill } = Tm;
  const TABS = [["all", "All"], ["active", "Active"], ["running", "Running"], ["queued", "Queued"], ["ended", "Finished"],
    ["failed", "Failed"]];
  const TYPES = ["chat", "translate", "flow", "task", "tool", "governed"];
  const SIZES = [25, 50, 100, 200];
  const DEFAULT = { tab: "all", team: "", type: "", model: "", executor: "", after: null, size: 50 };
  const FIELDS = Object.keys(DEFAULT);
  const apiBase = () => document.body.dataset.jobs;

  let view = { ...DEFAULT };
  let back = []; // the cursors of the pages before this one ("newer")
  let last = null; // the last state shown
  const buttons = new Map(); // "id:cancel" -> its button, kept across pushes so a click lands
  const selects = {};

  const sameView = (a, b) => FIELDS.every((f) => JSON.stringify(a[f] ?? null) === JSON.stringify(b[f] ?? null));
  const countText = (n, limit) => (n > limit ? `${limit.toLocaleString("en-US")}+` : n.toLocaleString("en-US"));

  // --- asking the server for a page ------------------------------------------------------------

  function ask(changes, keepPage = false) {
    if (!keepPage) back = [];
    view = { ...view, ...(keepPage ? {} : { after: null }), ...changes };
    $("jobs").classList.add("loading");
    const sent = Tm.sendView(view, (reply) => {
      if (reply.ok) return;
      $("jobs").classList.remove("loading");
      Tm.notice(`job list: ${Tm.words((reply.error || {}).fields || (reply.error || {}).detail)}`, "error");
    });
    if (!sent) $("jobs").classList.remove("loading");
    syncControls();
  }

  // --- tabs, filters, pager --------------------------------------------------------------------

  function buildControls() {
    const tabs = $("job-tabs");
    for (const [tab, label] of TABS) {
      tabs.append(node("button", {
        type: "button", role: "tab", id: `tab-${tab}`, dataset: { tab }, "aria-selected": "false",
        on: { click: () => ask({ tab }) },
      }, [node("span", { text: label }), node("span", { className: "n" })]));
    }
    const filters = $("job-filters");
    const choose = (name, label) => {
      selects[name] = node("select", { "aria-label": `filter by ${label}`, on: { change: () => ask({ [name]: selects[name].value }) } });
      filters.append(node("label", {}, [label, selects[name]]));
    };
    choose("team", "team");
    choose("type", "type");
    choose("model", "model");
    choose("executor", "executor");
    selects.size = node("select", { "aria-label": "jobs per page", on: { change: () => ask({ size: Number(selects.size.value) }) } },
      SIZES.map((n) => node("option", { value: String(n), text: String(n) })));
    filters.append(node("label", {}, ["per page", selects.size]));
    filters.append(node("span", { className: "end" }, [
      button("Clear filters", () => ask({ team: "", type: "", model: "", executor: "" }), { id: "clear-filters" }),
    ]));
  }

  function options(select, values, current, anyLabel) {
    const wanted = ["", ...values];
    if (current && !values.includes(current)) wanted.push(current);
    const have = [...select.options].map((o) => o.value);
    if (have.join("\u0000") !== wanted.join("\u0000")) {
      select.replaceChildren(...wanted.map((v) => node("option", { value: v, text: v || anyLabel })));
    }
    select.value = current;
  }

  function syncControls() {
    for (const tab of $("job-tabs").children) tab.setAttribute("aria-selected", String(tab.dataset.tab === view.tab));
    if (!last) return;
    const q = last.queue;
    options(selects.team, q.teams.map((t) => t.team), view.team, "any team");
    options(selects.type, TYPES, view.type, "any type");
    const models = [...new Set(q.executors.flatMap((e) => e.models))].sort();
    options(selects.model, models, view.model, "any model");
    options(selects.executor, q.executors.map((e) => e.name), view.executor, "any executor");
    selects.size.value = String(view.size);
    $("clear-filters").disabled = !(view.team || view.type || view.model || view.executor);
  }

  function renderTabs(s) {
    const counts = s.jobs_counts || {};
    for (const tab of $("job-tabs").children) {
      const n = counts[tab.dataset.tab];
      tab.querySelector(".n").textContent = n === undefined ? "" : countText(n, s.jobs_count_limit);
    }
  }

  function renderPager(s) {
    const pager = $("job-pager");
    const first = back.length * view.size + 1;
    const where = s.jobs.length
      ? `${first.toLocaleString("en-US")}–${(first + s.jobs.length - 1).toLocaleString("en-US")} of ${countText(s.jobs_total, s.jobs_count_limit)}`
      : "";
    pager.replaceChildren(
      button("← Newer", () => { const previous = back.pop(); ask({ after: previous ?? null }, true); }, { disabled: !back.length }),
      button("Older →", () => { back.push(view.after); ask({ after: s.jobs_next }, true); }, { disabled: !s.jobs_next }),
      ...(back.length ? [button("Newest", () => ask({}))] : []),
      node("span", { className: "where", text: where }),
    );
  }

  // --- the table -------------------------------------------------------------------------------

  function action(job, kind) {
    const key = `${job.id}:${kind}`;
    let b = buttons.get(key);
    if (!b) {
      b = kind === "cancel"
        ? button("Cancel", () => Tm.send("job.cancel", { job: job.id }, `cancel job ${job.id}`), { "aria-label": `cancel job ${job.id}`, className: "danger" })
        : button("Requeue", () => Tm.send("job.requeue", { job: job.id }, `requeue job ${job.id}`), { "aria-label": `requeue job ${job.id}` });
      buttons.set(key, b);
    }
    return b;
  }

  function actionsFor(job) {
    if (job.status === "queued" || job.status === "running") return [action(job, "cancel")];
    if (job.status === "failed" || job.status === "canceled") return [action(job, "requeue")];
    return [];
  }

  const waited = (j) => (j.started_at ? Tm.since(j.submitted_at, j.started_at) : j.status === "queued" ? Tm.since(j.submitted_at) : null);
  const ran = (j) => (j.started_at ? Tm.since(j.started_at, j.finished_at) : null);

  function idLink(j) {
    const key = `${j.id}:link`;
    let a = buttons.get(key);
    if (!a) {
      a = node("a", { href: j.link, text: String(j.id), title: "details", "aria-label": `details of job ${j.id}`,
        on: { click: (event) => {
          if (event.metaKey || event.ctrlKey || event.shiftKey || event.button !== 0) return;
          event.preventDefault();
          Tm.jobs.open(j.id);
        } } });
      buttons.set(key, a);
    }
    return a;
  }

  // One line per row: the whole text on hover and in the details.
  function noteText(text) {
    return text ? node("span", { text, title: text }) : "";
  }

  function renderTable(s) {
    const operator = s.operator;
    const headers = [["id", "num"], "status", "team", "user", "type", "model", ["pri", "num"], "executor", "round",
      ["att", "num"], ["tokens", "num"], "submitted", ["waited", "num"], ["ran", "num"], "waits because / error"];
    if (operator) headers.push("");
    const shown = new Set();
    const rows = s.jobs.map((j) => {
      shown.add(`${j.id}:cancel`); shown.add(`${j.id}:requeue`); shown.add(`${j.id}:link`);
      const note = j.error ? [noteText(j.error), "note error"] : [noteText(j.waits.join("; ")), "note"];
      const cells = [[idLink(j), "num"], [Tm.pill(j.status)], [j.team], [j.user], [j.type], [j.model], [j.priority, "num"],
        [j.executor || ""], [j.round_label], [j.attempts, "num"], [Tm.int(j.tokens_used), "num"], [Tm.time(j.submitted_at)],
        [Tm.duration(waited(j)), "num"], [Tm.duration(ran(j)), "num"], note];
      if (operator) cells.push([node("span", { className: "actions" }, actionsFor(j))]);
      return { cells, rowKey: String(j.id), rowClass: Tm.jobs.selected === j.id ? "selected" : "" };
    });
    for (const key of buttons.keys()) if (!shown.has(key)) buttons.delete(key);
    const empty = view.tab === "all" && !(view.team || view.type || view.model || view.executor)
      ? "no jobs yet" : "no jobs here: another tab, or fewer filters";
    fill($("jobs"), headers, rows, empty);
    const count = $("jobs-count");
    count.replaceChildren(`${countText(s.jobs_total, s.jobs_count_limit)} job${s.jobs_total === 1 ? "" : "s"} in this view · `,
      node("a", { href: s.jobs_link, text: "all jobs" }));
  }

  // --- details drawer --------------------------------------------------------------------------

  const detail = { id: null, signature: null, loadedAt: 0, terminal: false, loading: false };

  async function getJSON(url) {
    const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    const body = await response.json().catch(() => ({}));
    if (!response.ok) throw new Error(body.detail || `${response.status} ${response.statusText}`);
    return body;
  }

  function facts(pairs) {
    return node("dl", {}, pairs.filter(([, v]) => v !== "" && v !== null && v !== undefined)
      .flatMap(([k, v]) => [node("dt", { text: k }), node("dd", {}, [v instanceof Node ? v : String(v)])]));
  }

  const pretty = (value) => node("pre", { text: value === null || value === undefined ? "—"
    : (() => { const text = JSON.stringify(value, null, 2); return text.length > 20000 ? `${text.slice(0, 20000)}\n… (cut; the API has it all)` : text; })() });

  function metaText(meta) {
    return Object.entries(meta || {}).filter(([, v]) => v !== null && v !== "" && !(Array.isArray(v) && !v.length))
      .map(([k, v]) => `${k.replaceAll("_", " ")} ${typeof v === "object" ? JSON.stringify(v) : v}`).join(" · ");
  }

  function rounds(events) {
    const byRound = new Map();
    for (const e of events) {
      if (e.event !== "round_started" && e.event !== "round_finished") continue;
      const r = byRound.get(e.meta.round) || { round: e.meta.round };
      if (e.event === "round_started") r.started = e.at; else r.finished = e;
      byRound.set(e.meta.round, r);
    }
    return [...byRound.values()].sort((a, b) => a.round - b.round);
  }

  function renderDetail(job, events, row) {
    const panel = $("job-detail");
    const operator = last && last.operator;
    const actions = operator ? actionsFor(job).map((b) => b.cloneNode(true)) : [];
    for (const b of actions) {
      const kind = b.textContent === "Cancel" ? "job.cancel" : "job.requeue";
      b.addEventListener("click", () => Tm.send(kind, { job: job.id }, `${kind === "job.cancel" ? "cancel" : "requeue"} job ${job.id}`));
      b.setAttribute("aria-label", `${b.textContent.toLowerCase()} job ${job.id} (details)`);
    }
    const body = [facts([
      ["type", job.type], ["team", job.team], ["user", job.user], ["model", (job.requirements || {}).model],
      ["priority", job.priority], ["executor", job.executor || "—"], ["attempts", job.attempts],
      ["rounds", job.type === "flow" || job.type === "governed" ? job.rounds : ""], ["tokens", Tm.int(job.tokens_used)],
      ["submitted", Tm.stamp(job.submitted_at)], ["started", Tm.stamp(job.started_at)], ["finished", Tm.stamp(job.finished_at)],
      ["waited", Tm.duration(waited(job))], ["ran", Tm.duration(ran(job))],
      ["waits because", row && row.waits.length ? row.waits.join("; ") : ""],
    ])];
    if (job.error) body.push(node("h3", { text: "Error" }), node("div", { className: "error-box", text: job.error }));
    const done = rounds(events);
    if (done.length) {
      const table = node("table");
      fill(table, [["round", "num"], "started", ["took", "num"], ["tokens", "num"], "tools"], done.map((r) => [
        [r.round, "num"], [Tm.time(r.started)], [Tm.duration(r.finished ? (r.finished.meta.seconds ?? Tm.since(r.started, r.finished.at)) : null), "num"],
        [r.finished ? Tm.int(r.finished.meta.tokens) : "", "num"], [r.finished ? (r.finished.meta.tools || []).join(", ") : "running…"],
      ]));
      body.push(node("h3", { text: `Rounds (${done.length})` }), node("div", { className: "scroll" }, [table]));
    }
    const table = node("table");
    fill(table, ["at", "event", "executor", "details"], events.map((e) => [
      [Tm.time(e.at)], [e.event.replaceAll("_", " ")], [e.executor || ""], [metaText(e.meta), "meta"],
    ]), "no events");
    body.push(node("h3", { text: `Events (${events.length})` }), node("div", { className: "scroll" }, [table]));
    body.push(node("h3", { text: "Input" }), pretty(job.input), node("h3", { text: "Result" }), pretty(job.result));
    panel.replaceChildren(
      node("div", { className: "head" }, [
        node("h2", { text: `Job ${job.id}` }), Tm.pill(job.status),
        node("span", { className: "end" }, [
          ...actions,
          node("a", { href: row ? row.link : `${apiBase()}${job.id}/`, text: "open ↗", target: "_blank", rel: "noopener" }),
          button("Close", () => Tm.jobs.close(), { "aria-label": "close job details" }),
        ]),
      ]),
      node("div", { className: "body" }, body),
    );
  }

  async function load(id) {
    detail.loading = true;
    try {
      const [job, events] = await Promise.all([getJSON(`${apiBase()}${id}/`), getJSON(`${apiBase()}${id}/events/?page_size=500`)]);
      if (detail.id !== id) return;
      const row = last ? last.jobs.find((j) => j.id === id) : null;
      detail.terminal = ["done", "failed", "canceled"].includes(job.status);
      detail.loadedAt = Date.now();
      renderDetail(job, events.results || [], row);
    } catch (error) {
      if (detail.id === id) {
        $("job-detail").replaceChildren(node("div", { className: "head" }, [node("h2", { text: `Job ${id}` }),
          node("span", { className: "end" }, [button("Close", () => Tm.jobs.close(), { "aria-label": "close job details" })])]),
        node("div", { className: "body" }, [node("p", { className: "error-box", text: `Could not load it: ${error.message}` })]));
      }
    } finally {
      detail.loading = false;
    }
  }

  const signature = (row) => (row ? [row.status, row.attempts, row.tokens_used, row.round_label, row.executor].join("|") : null);

  // Reload the open job when its row changed, or now and then while it is live and not listed.
  function refreshDetail(s) {
    if (detail.id === null || detail.loading) return;
    const row = s.jobs.find((j) => j.id === detail.id);
    const sig = signature(row);
    if (row ? sig !== detail.signature : !detail.terminal && Date.now() - detail.loadedAt > 3000) {
      detail.signature = sig;
      load(detail.id);
    }
  }

  // --- public ----------------------------------------------------------------------------------

  Tm.jobs = {
    selected: null,
    render(s) {
      last = s;
      if (s.jobs_view && sameView(s.jobs_view, view)) $("jobs").classList.remove("loading");
      syncControls();
      renderTabs(s);
      renderTable(s);
      renderPager(s);
      refreshDetail(s);
    },
    tick(s) { renderTable(s); },
    reconnected() { if (!sameView(view, DEFAULT)) ask({}, true); },
    open(id) {
      this.selected = id;
      detail.id = id;
      detail.signature = last ? signature(last.jobs.find((j) => j.id === id)) : null;
      const panel = $("job-detail");
      panel.hidden = false;
      panel.replaceChildren(node("div", { className: "head" }, [node("h2", { text: `Job ${id}` }), node("span", { className: "muted", text: "loading…" })]));
      if (last) renderTable(last);
      load(id);
    },
    close() {
      this.selected = null;
      detail.id = null;
      $("job-detail").hidden = true;
      if (last) renderTable(last);
    },
  };

  buildControls();
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && Tm.jobs.selected !== null && !event.target.dataset.key) Tm.jobs.close();
  });
})();
