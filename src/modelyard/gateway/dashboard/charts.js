// The dashboard's traffic charts: small sparklines drawn as plain SVG from the routing-log records
// dashboard.js receives (`traffic.add`), redrawn every second (`traffic.draw`) on the gateway's
// clock (`traffic.setClock`, from each overview). Loaded before dashboard.js, whose helpers ($, el,
// fixed, percent) and model names (modelNames, modelNameSet) it reads when it runs.
"use strict";

// Per model, because that is how an LLM gateway is read: its models differ by orders of magnitude
// (a chat model answers in seconds, an embedding or echo model in milliseconds), so one P95 for the
// whole gateway would only show the slowest model's and hide a fast one getting slower. The first
// row is the whole gateway still, the place where requests for no known model (404s) show up.
// The data is the routing log this page follows anyway: no extra poll, and bounded whatever the
// rate (per series, WINDOW_S / BUCKET_S buckets of fixed size; series only for the gateway and the
// models the overview names). The work per second is bounded too, whatever the number of models:
// only the rows on screen are drawn, and a row with no traffic in the window only once.
const WINDOW_S = 300;
const BUCKET_S = 5;
const BUCKETS = WINDOW_S / BUCKET_S;
const RECENT_BUCKETS = 12; // the number beside each chart: the last minute, steadier than 5 s
// A bucket's latencies as a histogram of fixed bins, 4 per doubling from 0.01 ms (about ±9%),
// instead of every sample: a P95 to that precision in constant memory.
const BIN_FLOOR_MS = 0.01;
const BINS_PER_DOUBLING = 4;
const BINS = 27 * BINS_PER_DOUBLING; // up to 0.01 ms × 2^27, over 20 minutes
const CHART_W = 150;
const CHART_H = 26;
const GATEWAY_ROW = "";
const MAX_SERIES = 100; // names kept before the overview says which are models (then only those)
const SVG = "http://www.w3.org/2000/svg";

class Series {
  constructor() {
    this.buckets = new Map(); // bucket number (gateway time / BUCKET_S) -> {count, errors, served, bins}
  }

  add(bucket, record) {
    let b = this.buckets.get(bucket);
    if (!b) {
      b = { count: 0, errors: 0, served: 0, bins: new Uint32Array(BINS) };
      this.buckets.set(bucket, b);
    }
    b.count += 1;
    if (record.status >= 400) b.errors += 1;
    // A refusal's latency is how long saying no took, not a model's: left out of the P95.
    if (!record.refused) {
      const bin = Math.floor(Math.log2(Math.max(record.latency_ms, BIN_FLOOR_MS) / BIN_FLOOR_MS) * BINS_PER_DOUBLING);
      b.bins[Math.min(bin, BINS - 1)] += 1;
      b.served += 1;
    }
  }

  forgetBefore(bucket) {
    for (const key of this.buckets.keys()) if (key < bucket) this.buckets.delete(key);
  }

  // The last BUCKETS points, oldest first: requests/s, error share (null: no answer), P95 ms (null: none served).
  points(now) {
    const last = Math.floor(now / BUCKET_S);
    const rate = [];
    const errors = [];
    const p95 = [];
    for (let bucket = last - BUCKETS + 1; bucket <= last; bucket++) {
      const b = this.buckets.get(bucket);
      // The bucket still filling is a rate over the seconds it has had (at least one).
      const seconds = bucket === last ? Math.max(1, now - bucket * BUCKET_S) : BUCKET_S;
      rate.push(b ? b.count / seconds : 0);
      errors.push(b && b.count ? b.errors / b.count : null);
      p95.push(b && b.served ? percentile(b.bins, b.served, 0.95) : null);
    }
    return { rate, errors, p95 };
  }

  // The same over the last RECENT_BUCKETS buckets, the one still filling included.
  recent(now) {
    const last = Math.floor(now / BUCKET_S);
    const bins = new Uint32Array(BINS);
    let count = 0;
    let errors = 0;
    let served = 0;
    for (let bucket = last - RECENT_BUCKETS + 1; bucket <= last; bucket++) {
      const b = this.buckets.get(bucket);
      if (!b) continue;
      count += b.count;
      errors += b.errors;
      served += b.served;
      b.bins.forEach((n, i) => (bins[i] += n));
    }
    const seconds = (RECENT_BUCKETS - 1) * BUCKET_S + Math.max(1, now - last * BUCKET_S);
    return {
      rate: count / seconds,
      errors: count ? errors / count : null,
      p95: served ? percentile(bins, served, 0.95) : null,
    };
  }
}

function percentile(bins, total, q) {
  let seen = 0;
  for (let i = 0; i < bins.length; i++) {
    seen += bins[i];
    if (seen >= q * total) return BIN_FLOOR_MS * 2 ** ((i + 0.5) / BINS_PER_DOUBLING); // the bin's middle
  }
  return null;
}

const traffic = {
  series: new Map([[GATEWAY_ROW, new Series()]]),
  // The gateway's clock less this page's (records carry the gateway's time), from the overview's
  // `now`, taken halfway through the call that brought it (off by at most half its round trip).
  // Not from the records' times: those replayed when the page opens may be minutes old, and
  // would make old traffic look current. Null until the first overview: nothing is drawn before.
  skew: null,
  rowsStale: true, // the model names changed: the rows are made again at the next draw
  visible: new Set(), // the rows on screen (an IntersectionObserver says which): the ones drawn
  observer: null,

  setClock(gatewayNow, sentMs, receivedMs) {
    this.skew = (sentMs + receivedMs) / 2000 - gatewayNow;
  },

  add(record) {
    const bucket = Math.floor(record.time / BUCKET_S);
    // (before the gateway's clock is known every record is kept: the first draw forgets the old)
    if (this.skew !== null && bucket <= Math.floor(this.now() / BUCKET_S) - BUCKETS) return; // older than the window
    this.series.get(GATEWAY_ROW).add(bucket, record);
    if (!record.model || (modelNamesKnown && !modelNameSet.has(record.model))) return; // the gateway row only
    if (!this.series.has(record.model)) {
      if (this.series.size >= MAX_SERIES) return;
      this.series.set(record.model, new Series());
    }
    this.series.get(record.model).add(bucket, record);
  },

  now() {
    return Date.now() / 1000 - this.skew;
  },

  draw() {
    if (this.skew === null) return; // the gateway's clock is not known yet
    const now = this.now();
    const oldest = Math.floor(now / BUCKET_S) - BUCKETS + 1;
    for (const [name, series] of this.series) {
      if (name !== GATEWAY_ROW && modelNamesKnown && !modelNameSet.has(name)) this.series.delete(name); // no model
      else series.forgetBefore(oldest);
    }
    const body = $("traffic").tBodies[0];
    if (this.rowsStale) {
      this.rowsStale = false;
      if (!this.observer) this.observer = new IntersectionObserver((entries) => this.seen(entries));
      this.observer.disconnect();
      this.visible.clear();
      body.replaceChildren(...[GATEWAY_ROW, ...modelNames].map(trafficRow));
      for (const row of body.rows) this.observer.observe(row); // each is drawn once it shows
    }
    for (const row of this.visible) this.drawRow(row, now);
  },

  // Rows scrolled into view are drawn at once, not at the next second.
  seen(entries) {
    for (const entry of entries) {
      if (!entry.isIntersecting) {
        this.visible.delete(entry.target);
      } else if (entry.target.isConnected) {
        this.visible.add(entry.target);
        if (this.skew !== null) this.drawRow(entry.target, this.now());
      }
    }
  },

  drawRow(row, now) {
    const series = this.series.get(row.dataset.model);
    const idle = !series || series.buckets.size === 0; // nothing in the window: drawn once as such
    if (idle && row.dataset.idle === "true") return;
    row.dataset.idle = String(idle);
    const { rate, errors, p95 } = (series || new Series()).points(now);
    const recent = (series || new Series()).recent(now);
    const number = (v) => fixed(v, v < 1 ? 2 : v < 10 ? 1 : 0);
    drawChart(row, "rate", rate, Math.max(1, ...rate), recent.rate, (v) => number(v) + "/s");
    drawChart(row, "errors", errors, 1, recent.errors, percent);
    drawChart(row, "p95", p95, Math.max(1, ...p95.filter((v) => v !== null)), recent.p95, (v) => number(v) + " ms");
  },
};

function trafficRow(name) {
  const cell = (chart) => {
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("width", CHART_W);
    svg.setAttribute("height", CHART_H);
    svg.setAttribute("viewBox", `0 0 ${CHART_W} ${CHART_H}`);
    svg.setAttribute("class", "spark " + chart);
    svg.setAttribute("data-chart", chart);
    return el("td", { class: "chart" }, svg, el("span", { class: "current", "data-current": chart }, "–"));
  };
  const label = name === GATEWAY_ROW ? el("span", { class: "muted" }, "whole gateway") : name;
  return el("tr", { "data-model": name }, el("td", {}, label), cell("rate"), cell("errors"), cell("p95"));
}

// One sparkline: a polyline per run of points with a value (a gap where there was no answer),
// scaled to `max`; beside it `recent`, the value over the last minute.
function drawChart(row, chart, values, max, recent, format) {
  const svg = row.querySelector(`svg[data-chart='${chart}']`);
  const step = CHART_W / (values.length - 1);
  const runs = [];
  let run = [];
  values.forEach((value, i) => {
    if (value === null) {
      if (run.length) runs.push(run);
      run = [];
      return;
    }
    const y = CHART_H - 1 - (Math.min(value, max) / max) * (CHART_H - 2);
    run.push(`${(i * step).toFixed(1)},${y.toFixed(1)}`);
  });
  if (run.length) runs.push(run);
  svg.replaceChildren(
    ...runs.map((points) => {
      const line = document.createElementNS(SVG, points.length > 1 ? "polyline" : "circle");
      if (points.length > 1) {
        line.setAttribute("points", points.join(" "));
      } else {
        const [x, y] = points[0].split(",");
        line.setAttribute("cx", x);
        line.setAttribute("cy", y);
        line.setAttribute("r", "1.5");
      }
      return line;
    }),
  );
  const current = row.querySelector(`[data-current='${chart}']`);
  current.textContent = recent === null ? "–" : format(recent);
  current.dataset.value = recent === null ? "" : String(recent);
  svg.dataset.points = String(values.filter((value) => value !== null).length);
}
