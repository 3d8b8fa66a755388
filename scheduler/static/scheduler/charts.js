// The dashboard's charts, drawn with uPlot (vendored: vendor/uplot-1.6.32/README.md says why).
// History comes from GET /api/queue/history/ (buckets the workers record, a minute each by
// default: scheduler/services/history.py), fetched again as each bucket closes; the gauges
// (queued, running, slots) are carried on from every pushed state, so the right edge of the
// charts is live. A chart for spend appears once the history holds a `cost` measure.
"use strict";

(() => {
  const { $, node, button } = Tm;
  const RANGES = [[15, "15 m"], [60, "1 h"], [360, "6 h"], [1440, "24 h"]];
  const PALETTE = ["#1f5fd6", "#e8590c", "#2b8a3e", "#ae3ec9", "#e0a800", "#0c8599", "#c92a2a", "#5c7cfa", "#74b816", "#868e96"];
  // Time axis ticks: whole seconds at least (the history has no finer grain).
  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
  // Counts are whole: no 2.5-job ticks.
  const WHOLE_STEPS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1e3, 2e3, 2.5e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6, 1e7, 1e8];
  const LIVE_EVERY_MS = 2000; // at most one live point this often
  const MAX_LIVE = 900;

  let minutes = 60;
  let history = null;
  let live = []; // [{t, teams: {slug: {queued, running, in_use}}, executors: {name: {in_use, limit}}}]
  let liveSince = 0; // when the newest live point was added
  let timer = null;
  const plots = new Map(); // chart id -> {u, key}
  const colours = new Map(); // name -> colour, stable across charts and refreshes

  function colour(name) {
    if (!colours.has(name)) colours.set(name, PALETTE[colours.size % PALETTE.length]);
    return colours.get(name);
  }

  // --- what each chart draws -------------------------------------------------------------------
  // A series: {label, colour, history: [...] aligned with history.times, live: (point) => value|null, dash}

  const teamsOf = (h) => Object.keys(h.teams).sort();
  const sumOf = (values) => values.reduce((a, v) => a + (v || 0), 0);

  const CHARTS = [
    {
      id: "queued", title: "Queued", unit: "jobs per team",
      series: (h) => teamsOf(h).map((t) => ({ label: t, colour: colour(`team:${t}`), history: h.teams[t].queued,
        live: (p) => (p.teams[t] ? p.teams[t].queued : 0) })),
    },
    {
      id: "running", title: "Running", unit: "jobs per team",
      series: (h) => teamsOf(h).map((t) => ({ label: t, colour: colour(`team:${t}`), history: h.teams[t].running,
        live: (p) => (p.teams[t] ? p.teams[t].running : 0) })),
    },
    {
      id: "slots", title: "Executor slots", unit: "in use, limit dashed",
      series: (h) => Object.keys(h.executors).sort().flatMap((e) => [
        { label: e, colour: colour(`executor:${e}`), history: h.executors[e].in_use, live: (p) => (p.executors[e] ? p.executors[e].in_use : null) },
        { label: `${e} limit`, colour: colour(`executor:${e}`), history: h.executors[e].limit, dash: [5, 4], width: 1,
          live: (p) => (p.executors[e] ? p.executors[e].limit : null) },
      ]),
    },
    {
      id: "wait", title: "Queue wait", unit: "seconds to first start, p50 and p95", format: (v) => Tm.duration(v),
      series: (h) => [
        { label: "p50", colour: "#1f5fd6", history: h.global.wait_p50 || [] },
        { label: "p95", colour: "#c92a2a", history: h.global.wait_p95 || [] },
      ],
    },
    {
      id: "tokens", title: "Tokens", unit: "per team, by bucket of jobs ended",
      series: (h) => teamsOf(h).map((t) => ({ label: t, colour: colour(`team:${t}`), history: h.teams[t].tokens })),
    },
    {
      // Spend: drawn once the workers record a `cost` per team (scheduler/services/history.py, _sums).
      id: "cost", title: "Spend", unit: "per team, by bucket of jobs ended", when: (h) => teamsOf(h).some((t) => h.teams[t].cost),
      format: (v) => (v === null || v === undefined ? "" : v.toFixed(v < 1 ? 4 : 2)),
      series: (h) => teamsOf(h).filter((t) => h.teams[t].cost).map((t) => ({ label: t, colour: colour(`team:${t}`), history: h.teams[t].cost })),
    },
    {
      id: "ended", title: "Jobs ended", unit: "all teams, per bucket",
      series: (h) => [
        { label: "finished", colour: "#2b8a3e", history: h.global.finished || [] },
        { label: "failed", colour: "#c92a2a", history: h.global.failed || [] },
        { label: "canceled", colour: "#868e96", history: h.global.canceled || [] },
      ],
    },
  ];

  // --- drawing ---------------------------------------------------------------------------------

  function figure(chart) {
    let fig = $(`chart-${chart.id}`);
    if (!fig) {
      fig = node("figure", { className: "chart", id: `chart-${chart.id}` }, [
        node("figcaption", {}, [node("span", { text: chart.title }), node("span", { className: "unit", text: chart.unit })]),
        node("div", { className: "plot" }),
      ]);
      $("chart-grid").append(fig);
    }
    return fig;
  }

  function data(chart, series) {
    const last = history.times.length ? history.times[history.times.length - 1] : 0;
    const tail = live.filter((p) => p.t > last);
    const x = [...history.times, ...tail.map((p) => p.t)];
    // A measure the history does not hold yet (a new executor, say) is a gap, not an error.
    const ys = series.map((s) => [...history.times.map((_, i) => (s.history ? s.history[i] ?? null : null)),
      ...tail.map((p) => (s.live ? s.live(p) : null))]);
    return [x, ...ys];
  }

  // Tick labels as wall-clock times: 14:05, or 14:05:30 when ticks are less than a minute apart.
  function clock(ticks) {
    const seconds = ticks.length > 1 && ticks[1] - ticks[0] < 60;
    return ticks.map((t) => new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", hourCycle: "h23",
      ...(seconds ? { second: "2-digit" } : {}) }));
  }

  function newest(values) {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null && values[i] !== undefined) return values[i];
    return null;
  }

  function options(chart, series, width) {
    const format = chart.format || ((v) => Tm.short(v));
    return {
      width,
      height: 150,
      cursor: { points: { size: 6 }, drag: { x: false, y: false } },
      legend: { live: true },
      scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(max * 1.1, chart.id === "wait" ? 0.1 : 1)] } },
      axes: [
        { stroke: "#66727f", grid: { stroke: "#eef1f4", width: 1 }, ticks: { stroke: "#dfe4eb", width: 1 }, font: "11px system-ui", size: 28,
          space: 70, incrs: TIME_STEPS, values: (u, ticks) => clock(ticks) },
        { stroke: "#66727f", grid: { stroke: "#eef1f4", width: 1 }, ticks: { show: false }, font: "11px system-ui", size: 44,
          ...(chart.format ? {} : { incrs: WHOLE_STEPS }), values: (u, values) => values.map((v) => format(v)) },
      ],
      series: [{}, ...series.map((s) => ({
        label: s.label, stroke: s.colour, width: s.width || 1.6, dash: s.dash, points: { show: false },
        // Hovered: the value there; otherwise the newest value, so the legend reads as a status line.
        value: (u, v, si, idx) => {
          const shown = idx === null ? newest(u.data[si]) : v;
          return shown === null || shown === undefined ? "–" : format(shown);
        },
      }))],
    };
  }

  function draw(chart) {
    const fig = figure(chart);
    const shown = !chart.when || chart.when(history);
    fig.hidden = !shown;
    if (!shown) return;
    const series = chart.series(history);
    const plot = fig.querySelector(".plot");
    const rows = data(chart, series);
    const key = series.map((s) => s.label).join("\u0000");
    const width = Math.max(plot.clientWidth, 200);
    let entry = plots.get(chart.id);
    if (entry && entry.key !== key) {
      entry.u.destroy();
      entry = null;
    }
    if (!entry) {
      plot.replaceChildren();
      entry = { u: new uPlot(options(chart, series, width), rows, plot), key };
      plots.set(chart.id, entry);
    } else {
      entry.u.setData(rows);
      if (entry.u.cursor.idx === null || entry.u.cursor.idx === undefined) entry.u.setLegend({ idx: null });
    }
    // What is drawn, for people (an empty chart says why) and for tests.
    const values = rows.slice(1).flat().filter((v) => v !== null && v !== undefined);
    fig.dataset.series = String(series.length);
    fig.dataset.points = String(values.length);
    fig.dataset.nonzero = String(values.filter((v) => v > 0).length);
    let empty = fig.querySelector(".empty");
    if (!values.length) {
      if (!empty) plot.append(empty = node("div", { className: "empty" }));
      empty.textContent = series.length ? `No history yet: the workers record a point every ${Tm.every(history.bucket_seconds)}.`
        : "Nothing to draw.";
    } else if (empty) empty.remove();
  }

  function drawAll() {
    if (!history || typeof uPlot === "undefined") return;
    for (const chart of CHARTS) draw(chart);
    summarise();
  }

  // The key figures that come from history: the latest wait p95 and the tokens in the range.
  function summarise() {
    const g = history.global;
    const p95 = (g.wait_p95 || []).filter((v) => v !== null);
    const p50 = (g.wait_p50 || []).filter((v) => v !== null);
    Tm.kpi("kpi-wait", p95.length ? Tm.duration(p95[p95.length - 1]) : "–",
      p50.length ? `p50 ${Tm.duration(p50[p50.length - 1])}` : "no job started in this range");
    const tokens = sumOf(g.tokens || []);
    const cost = sumOf(g.cost || []);
    const label = RANGES.find(([m]) => m === minutes)[1];
    Tm.kpi("kpi-tokens", Tm.short(tokens), `last ${label}${g.cost ? ` · spend ${cost.toFixed(2)}` : ""}`);
    $("charts-note").textContent = `last ${label} · a point every ${Tm.every(history.step_seconds)}, live at the right edge`;
  }

  // --- data in ---------------------------------------------------------------------------------

  async function fetchHistory() {
    clearTimeout(timer);
    try {
      const url = `${document.body.dataset.history}?minutes=${minutes}`;
      const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (response.ok) {
        history = await response.json();
        drawAll();
      }
    } catch (error) {
      // The socket's status line tells the operator the server is unreachable; retry below.
    }
    const every = history ? Math.max(history.bucket_seconds, 2) : 5;
    timer = setTimeout(fetchHistory, every * 1000 + 300);
  }

  function buildRange() {
    const group = $("chart-range");
    group.replaceChildren(...RANGES.map(([m, label]) => button(label, () => {
      minutes = m;
      for (const b of group.children) b.setAttribute("aria-pressed", String(b.dataset.minutes === String(m)));
      fetchHistory();
    }, { dataset: { minutes: String(m) }, "aria-pressed": String(m === minutes), "aria-label": `chart range ${label}` })));
  }

  Tm.charts = {
    start() {
      buildRange();
      fetchHistory();
      let width = 0;
      new ResizeObserver(() => {
        const now = $("chart-grid").clientWidth;
        if (now === width) return;
        width = now;
        for (const [id, entry] of plots) {
          const plot = $(`chart-${id}`).querySelector(".plot");
          entry.u.setSize({ width: Math.max(plot.clientWidth, 200), height: 150 });
        }
      }).observe($("chart-grid"));
    },
    // A pushed state: its gauges become the newest point of the live edge.
    live(s) {
      const t = Tm.now() / 1000;
      const point = { t, teams: {}, executors: {} };
      for (const team of s.queue.teams) point.teams[team.team] = { queued: team.queued, running: team.running, in_use: team.in_use };
      for (const e of s.queue.executors) point.executors[e.name] = { in_use: e.in_use, limit: e.limit };
      // A burst of pushes moves the newest point instead of adding one each time.
      if (live.length && (t - liveSince) * 1000 < LIVE_EVERY_MS) live[live.length - 1] = point;
      else { live.push(point); liveSince = t; }
      const oldest = t - minutes * 60;
      live = live.filter((p) => p.t >= oldest).slice(-MAX_LIVE);
      drawAll();
    },
  };
})();
