// The dashboard's charts, drawn with uPlot (vendored: vendor/uplot-1.6.32/README.md says why).
// History comes from GET /api/queue/history/ (buckets the workers record, a minute each by
// default: scheduler/services/history.py), fetched again as each bucket closes; the gauges
// (queued, running, slots) and the open bucket's queue wait are carried on from every pushed
// state, so the right edge of the charts is live. A chart for spend appears once the history
// holds a `cost` measure.
//
// Each value stands for a stretch of time: a bucket's (for a gauge, the most it was at once within
// the bucket; for a count, what happened in it), or a live reading's since the one before. So every
// series is drawn as steps, each value level across its stretch up to its time: a straight line
// from one bucket's end to the next would draw a ramp that never happened. The key figures that
// come from the history (queue wait, tokens, spend) read the same values the charts draw.
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
  // [{t, teams: {slug: {queued, running, in_use}}, executors: {name: {in_use, limit}}, waits}]: `waits` is the
  // open bucket's queue waits so far when a job started in it (scheduler/live/snapshot.py, queue_waits)
  let live = [];
  let oldestQueued = null; // when the job waiting longest now entered the queue
  let liveSince = 0; // when the newest live point was added
  let timer = null;
  const plots = new Map(); // chart id -> {u, key}
  const drawn = new Map(); // chart id -> {x, ys, tail}: what it draws, for the key figures
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
      id: "queued", title: "Queued", unit: "jobs per team, most at once",
      series: (h) => teamsOf(h).map((t) => ({ label: t, colour: colour(`team:${t}`), history: h.teams[t].queued,
        live: (p) => (p.teams[t] ? p.teams[t].queued : 0) })),
    },
    {
      id: "running", title: "Running", unit: "jobs per team, most at once",
      series: (h) => teamsOf(h).map((t) => ({ label: t, colour: colour(`team:${t}`), history: h.teams[t].running,
        live: (p) => (p.teams[t] ? p.teams[t].running : 0) })),
    },
    {
      id: "slots", title: "Executor slots", unit: "most in use at once, limit dashed",
      series: (h) => Object.keys(h.executors).sort().flatMap((e) => [
        { label: e, colour: colour(`executor:${e}`), history: h.executors[e].in_use, live: (p) => (p.executors[e] ? p.executors[e].in_use : null) },
        { label: `${e} limit`, colour: colour(`executor:${e}`), history: h.executors[e].limit, dash: [5, 4], width: 1,
          live: (p) => (p.executors[e] ? p.executors[e].limit : null) },
      ]),
    },
    {
      id: "wait", title: "Queue wait", unit: "seconds to first start, p50 and p95", format: (v) => Tm.duration(v), top: 0.1,
      series: (h) => [
        { label: "p50", colour: "#1f5fd6", history: h.global.wait_p50 || [], live: (p) => p.waits && p.waits.wait_p50 },
        { label: "p95", colour: "#c92a2a", history: h.global.wait_p95 || [], live: (p) => p.waits && p.waits.wait_p95 },
      ],
    },
    {
      id: "tokens", title: "Tokens", unit: "per team, by bucket of jobs ended",
      series: (h) => teamsOf(h).map((t) => ({ label: t, colour: colour(`team:${t}`), history: h.teams[t].tokens })),
    },
    {
      // Spend: drawn once the workers record a `cost` per team (scheduler/services/history.py, _sums).
      id: "cost", title: "Spend", unit: (h) => `${h.currency} per team, by bucket of jobs ended`,
      when: (h) => teamsOf(h).some((t) => h.teams[t].cost), format: (v) => Tm.money(v), top: 0.0001,
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
        node("figcaption", {}, [node("span", { text: chart.title }), node("span", { className: "unit" })]),
        node("div", { className: "plot" }),
      ]);
      $("chart-grid").append(fig);
    }
    fig.querySelector(".unit").textContent = typeof chart.unit === "function" ? chart.unit(history) : chart.unit;
    return fig;
  }

  // Each series' values at their times: the history's steps, then the live readings after them.
  function data(chart, series) {
    const last = history.times.length ? history.times[history.times.length - 1] : 0;
    const tail = live.filter((p) => p.t > last);
    const x = [...history.times, ...tail.map((p) => p.t)];
    // A measure the history does not hold yet (a new executor, say) is a gap, not an error.
    const ys = series.map((s) => [...history.times.map((_, i) => (s.history ? s.history[i] ?? null : null)),
      ...tail.map((p) => (s.live ? s.live(p) ?? null : null))]);
    return { x, ys, tail };
  }

  // What uPlot draws: a step's value is level from its start to its time, so the first step needs
  // its start too (the history's `since`), with its own value.
  function plotted(rows) {
    if (!history.times.length) return [rows.x, ...rows.ys];
    return [[history.since, ...rows.x], ...rows.ys.map((ys) => [ys[0], ...ys])];
  }

  // 14:05, or 14:05:30 when `seconds`.
  const hhmm = (t, seconds) => new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", hourCycle: "h23",
    ...(seconds ? { second: "2-digit" } : {}) });

  // Tick labels as wall-clock times: 14:05, or 14:05:30 when ticks are less than a minute apart.
  function clock(ticks) {
    const seconds = ticks.length > 1 && ticks[1] - ticks[0] < 60;
    return ticks.map((t) => hhmm(t, seconds));
  }

  function newest(values) {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null && values[i] !== undefined) return values[i];
    return null;
  }

  function options(chart, series, width) {
    const format = chart.format || ((v) => Tm.short(v));
    // Level up to each point from the one before; a gap (null) hides its own stretch only.
    const steps = uPlot.paths.stepped({ align: -1, alignGaps: -1 });
    return {
      width,
      height: 150,
      cursor: { points: { size: 6 }, drag: { x: false, y: false } },
      legend: { live: true },
      // The y axis reaches a little past the highest value, and at least to the chart's `top` (one
      // job, 0.1 s, 0.0001 of money), so a small amount is drawn as what it is, not as zero.
      scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(max * 1.1, chart.top || 1)] } },
      axes: [
        { stroke: "#66727f", grid: { stroke: "#eef1f4", width: 1 }, ticks: { stroke: "#dfe4eb", width: 1 }, font: "11px system-ui", size: 28,
          space: 70, incrs: TIME_STEPS, values: (u, ticks) => clock(ticks) },
        { stroke: "#66727f", grid: { stroke: "#eef1f4", width: 1 }, ticks: { show: false }, font: "11px system-ui", size: 44,
          ...(chart.format ? {} : { incrs: WHOLE_STEPS }), values: (u, values) => values.map((v) => format(v)) },
      ],
      series: [{}, ...series.map((s) => ({
        label: s.label, stroke: s.colour, width: s.width || 1.6, dash: s.dash, points: { show: false }, paths: steps,
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
    const values = data(chart, series);
    drawn.set(chart.id, values);
    const rows = plotted(values);
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
    const points = values.ys.flat().filter((v) => v !== null && v !== undefined);
    fig.dataset.series = String(series.length);
    fig.dataset.points = String(points.length);
    fig.dataset.nonzero = String(points.filter((v) => v > 0).length);
    fig.dataset.max = points.length ? String(Math.max(...points)) : "";
    let empty = fig.querySelector(".empty");
    if (!points.length) {
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

  // The key figures that come from history, as the charts draw them: the queue wait is the wait
  // chart's newest point (the open bucket's so far when a job started in it, else the last bucket
  // recorded, and says which), beside the longest wait of a job still queued; tokens and spend
  // add up the range.
  function summarise() {
    const g = history.global;
    const wait = drawn.get("wait");
    let newest = -1;
    if (wait) for (let i = wait.x.length - 1; i >= 0 && newest < 0; i--) if (wait.ys[1][i] !== null) newest = i;
    let sub = "no job started in this range";
    if (newest >= 0) {
      const p50 = `p50 ${Tm.duration(wait.ys[0][newest])}`;
      const seconds = history.bucket_seconds % 60 !== 0;
      const point = wait.tail[newest - (wait.x.length - wait.tail.length)];
      sub = point
        ? `${p50} · ${point.waits.started} started since ${hhmm(Date.parse(point.waits.since) / 1000, seconds)}`
        : `${p50} · ${Tm.every(history.bucket_seconds)} to ${hhmm(wait.x[newest], seconds)}`;
    }
    Tm.kpi("kpi-wait", newest >= 0 ? Tm.duration(wait.ys[1][newest]) : "–", sub);
    $("kpi-wait-queued").textContent = oldestQueued ? `queued now: longest ${Tm.duration(Tm.since(oldestQueued))}`
      : "none queued now";
    const tokens = sumOf(g.tokens || []);
    const label = RANGES.find(([m]) => m === minutes)[1];
    const spend = g.cost ? ` · spend ${Tm.money(sumOf(g.cost))} ${history.currency}` : "";
    Tm.kpi("kpi-tokens", Tm.short(tokens), `last ${label}${spend}`);
    $("charts-note").textContent = `last ${label} · a step every ${Tm.every(history.step_seconds)} `
      + "(queued, running, slots: the most at once in it) · live at the right edge";
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
    // A pushed state: its gauges and the open bucket's queue wait become the newest point of the
    // live edge.
    live(s) {
      const t = Tm.now() / 1000;
      oldestQueued = s.waits.oldest_queued_at;
      const point = { t, teams: {}, executors: {}, waits: s.waits.started > 0 ? s.waits : null };
      for (const team of s.queue.teams) point.teams[team.team] = { queued: team.queued, running: team.running, in_use: team.in_use };
      for (const e of s.queue.executors) point.executors[e.name] = { in_use: e.in_use, limit: e.limit };
      // A burst of pushes moves the newest point instead of adding one each time.
      if (live.length && (t - liveSince) * 1000 < LIVE_EVERY_MS) live[live.length - 1] = point;
      else { live.push(point); liveSince = t; }
      const oldest = t - minutes * 60;
      live = live.filter((p) => p.t >= oldest).slice(-MAX_LIVE);
      drawAll();
    },
    // A heartbeat: the longest wait of a queued job goes on growing.
    tick() {
      if (history) summarise();
    },
  };
})();
