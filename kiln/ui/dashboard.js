// The dashboard: polls /v1/dashboard/stats every second and plots the last five minutes.
//
// The endpoint sends the metrics registry's cumulative values (the numbers /metrics shows);
// everything over time is computed here, from two polls, the way Prometheus' rate() and
// histogram_quantile() do it: a rate is the counter's difference over the time between two
// polls RATE_WINDOW seconds apart; a percentile is interpolated inside the histogram bucket that
// holds it, over the bucket counts' difference across the sliding window (WINDOW seconds). TTFT
// and inter-token latency are observed when a request finishes (as in vLLM), so their
// percentiles move at each finish.
"use strict";

const KilnDash = (() => {
  const POLL_MS = 1000;
  const SPAN = 300; // seconds shown
  const WINDOW = 60; // seconds a percentile or hit rate covers
  // seconds a rate covers: engine steps can be longer than a poll on a busy CPU, and a rate
  // between two polls would then swing between 0 and a spike
  const RATE_WINDOW = 5;
  const COLORS = ["#c2410c", "#2563eb", "#16a34a", "#9333ea"];
  const $ = (id) => document.getElementById(id);

  // q-quantile of cumulative bucket counts (`counts` has one more entry than `bounds`: +Inf).
  // Linear inside the bucket; in the +Inf bucket, the highest finite bound (as Prometheus).
  function quantile(q, bounds, counts) {
    const total = counts[counts.length - 1];
    if (!(total > 0)) return null;
    const rank = q * total;
    for (let i = 0; i < counts.length; i++) {
      if (counts[i] >= rank) {
        if (i >= bounds.length) return bounds[bounds.length - 1];
        const lo = i === 0 ? 0 : bounds[i - 1];
        const below = i === 0 ? 0 : counts[i - 1];
        const inside = counts[i] - below;
        return inside > 0 ? lo + (bounds[i] - lo) * (rank - below) / inside : bounds[i];
      }
    }
    return bounds[bounds.length - 1];
  }

  // Bucket counts observed between two snapshots of one histogram (null: none, or a restart).
  function histDelta(now, before) {
    if (!now || !before) return null;
    if (before.counts.length !== now.counts.length) return null;
    const d = now.counts.map((c, i) => c - before.counts[i]);
    return d[d.length - 1] > 0 && d.every((v) => v >= 0) ? d : null;
  }

  const PLOTS = {
    throughput: { series: ["generated", "prompt"], yMax: 1, format: num, unit: " tok/s" },
    ttft: { series: ["p50", "p90", "p99"], yMax: 0.1, format: seconds, unit: "" },
    itl: { series: ["p50", "p90", "p99"], yMax: 0.04, format: seconds, unit: "" },
    requests: { series: ["running", "waiting"], yMax: 4, format: num, unit: "" },
    kv: { series: ["used"], yMax: 10, format: (v) => num(v) + "%", unit: "" },
    prefix: { series: ["hit rate"], yMax: 10, format: (v) => num(v) + "%", unit: "" },
  };

  // Three significant digits at most, no trailing zeros (axis labels and current values).
  function num(v) {
    return Math.abs(v) >= 100 ? v.toFixed(0) : String(parseFloat(v.toPrecision(3)));
  }

  function seconds(v) {
    if (v === null || v === undefined) return "\u2013";
    return v >= 1 ? num(v) + " s" : num(v * 1000) + " ms";
  }

  // One derived point per poll: [t, y] per series of each plot.
  const points = {};
  const plots = {};
  let samples = []; // [{t, m}] of the shown model
  let model = null;

  function derive(s, prev) {
    const t = s.t, m = s.m;
    const base = samples.find((x) => x.t >= t - WINDOW) || s;
    const since = samples.find((x) => x.t >= t - RATE_WINDOW) || prev;
    const rate = (key) => {
      if (!since) return null;
      const a = m.counters[key], b = since.m.counters[key], dt = t - since.t;
      return a === null || b === null || dt <= 0 || a < b ? null : (a - b) / dt;
    };
    const pct = (key, qs) => {
      const h = m.histograms[key];
      // the first poll has no window behind it yet
      const d = h && base !== s ? histDelta(h, base.m.histograms[key]) : null;
      return qs.map((q) => (d ? quantile(q, h.bounds, d) : null));
    };
    const dq = m.counters.prefix_cache_queries - (base.m.counters.prefix_cache_queries || 0);
    const dh = m.counters.prefix_cache_hits - (base.m.counters.prefix_cache_hits || 0);
    const g = m.gauges;
    return {
      throughput: [rate("generation_tokens"), rate("prompt_tokens")],
      ttft: pct("ttft", [0.5, 0.9, 0.99]),
      itl: pct("itl", [0.5, 0.9, 0.99]),
      requests: [g.running, g.waiting],
      kv: [g.kv_usage === null ? null : 100 * g.kv_usage],
      prefix: [base !== s && dq > 0 ? 100 * dh / dq : null],
    };
  }

  function setupPlots() {
    for (const card of document.querySelectorAll("[data-plot]")) {
      const key = card.dataset.plot;
      const spec = PLOTS[key];
      const series = spec.series.map((name, i) => ({ name, color: COLORS[i] }));
      plots[key] = new LinePlot(card.querySelector("canvas"),
        { series, span: SPAN, yMax: spec.yMax, format: spec.format });
      points[key] = series.map(() => []);
      const legend = card.querySelector(".legend");
      for (const s of series) {
        const item = document.createElement("span");
        const swatch = document.createElement("i");
        swatch.style.background = s.color;
        item.append(swatch, document.createTextNode(s.name));
        legend.appendChild(item);
      }
    }
    $("plot-note").textContent = "Polled every " + POLL_MS / 1000 + " s; rates over the last " +
      RATE_WINDOW + " s, percentiles and hit rate over the last " + WINDOW + " s, from the " +
      "same histograms and counters as /metrics (TTFT and inter-token latency count when a " +
      "request finishes).";
  }

  function add(stats) {
    const models = stats.models || [];
    const select = $("dash-model");
    const names = models.map((m) => m.name);
    if (select.options.length !== names.length ||
        names.some((n, i) => select.options[i].value !== n)) {
      select.textContent = "";
      for (const n of names) {
        const o = document.createElement("option");
        o.value = o.textContent = n;
        select.appendChild(o);
      }
      select.value = model && names.includes(model) ? model : names[0];
    }
    const m = models.find((x) => x.name === select.value) || models[0];
    if (!m) return;
    if (m.name !== model) { // another model: start its history afresh
      model = m.name;
      samples = [];
      for (const key in points) points[key] = points[key].map(() => []);
    }
    $("served").textContent = "served as " + m.served_names.join(", ") +
      (m.max_model_len ? " \u00b7 context " + m.max_model_len : "") +
      (m.gauges.kv_blocks_total ? " \u00b7 " + m.gauges.kv_blocks_total + " KV blocks" : "") +
      " \u00b7 kiln " + stats.version;
    const s = { t: stats.time, m };
    const prev = samples[samples.length - 1];
    if (prev && s.t <= prev.t) return;
    const d = derive(s, prev);
    samples.push(s);
    while (samples.length && samples[0].t < s.t - SPAN - WINDOW) samples.shift();
    for (const key in d) {
      d[key].forEach((v, i) => {
        const pts = points[key][i];
        pts.push([s.t, v === undefined ? null : v]);
        while (pts.length && pts[0][0] < s.t - SPAN) pts.shift();
      });
    }
    draw(s.t, d);
  }

  function draw(now, latest) {
    for (const key in plots) {
      plots[key].draw(points[key], now);
      const spec = PLOTS[key];
      const text = latest[key].map((v, i) => spec.series[i] + " " +
        (v === null || v === undefined ? "\u2013" : spec.format(v) + spec.unit)).join("  ");
      document.querySelector('[data-plot="' + key + '"] .now').textContent = text;
    }
  }

  async function poll() {
    try {
      const stats = await KilnAPI.getJSON("/v1/dashboard/stats");
      add(stats);
      $("poll-status").textContent = "live";
    } catch (e) {
      $("poll-status").textContent = "cannot read the stats: " + e.message;
    }
    setTimeout(poll, POLL_MS);
  }

  // ------------------------------------------------------------------ the effective config

  let config = null;

  function show(value) {
    if (value === null || value === undefined) return "\u2013";
    return typeof value === "string" ? value : JSON.stringify(value);
  }

  function renderConfig() {
    const body = document.querySelector("#config-table tbody");
    body.textContent = "";
    if (!config) return;
    const filter = $("config-filter").value.trim().toLowerCase();
    const changed = $("config-changed").checked;
    for (const [name, r] of Object.entries(config.settings || {})) {
      if (changed && r.source === "default") continue;
      const row = [name, show(r.value), r.source, r.reason || "", r.affects || ""];
      if (filter && !row.join(" ").toLowerCase().includes(filter)) continue;
      const tr = document.createElement("tr");
      tr.dataset.setting = name;
      ["name", "value", "source", "reason", "affects"].forEach((cls, i) => {
        const td = document.createElement("td");
        td.className = cls;
        if (cls === "source") {
          const tag = document.createElement("span");
          tag.className = "src-" + row[i];
          tag.textContent = row[i];
          td.appendChild(tag);
        } else {
          td.textContent = row[i];
        }
        tr.appendChild(td);
      });
      body.appendChild(tr);
    }
  }

  async function loadConfig() {
    try {
      config = await KilnAPI.getJSON("/v1/dashboard/config");
      const preset = config.preset && config.preset.name
        ? "preset " + config.preset.name +
          (config.preset.reason ? " (" + config.preset.reason + ")" : "")
        : "no preset";
      $("config-meta").textContent = preset + (config.config_file ? " \u00b7 config file " +
        config.config_file : "");
    } catch (e) {
      $("config-meta").textContent = "cannot read the config: " + e.message;
    }
    renderConfig();
  }

  setupPlots();
  $("config-filter").addEventListener("input", renderConfig);
  $("config-changed").addEventListener("change", renderConfig);
  $("dash-model").addEventListener("change", () => { model = null; });
  $("set-key").addEventListener("click", async () => {
    if (await KilnAPI.askKey(false)) loadConfig();
  });
  window.addEventListener("resize", () => {
    const last = samples[samples.length - 1];
    if (last) for (const key in plots) plots[key].draw(points[key], last.t);
  });
  loadConfig();
  poll();

  return { quantile, points, samples: () => samples, WINDOW };
})();
