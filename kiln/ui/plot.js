// A small time-series line plot on a <canvas>: a few named series of [t, y] points (t in
// seconds), drawn over the last `span` seconds with a y axis that grows to fit (never below
// `yMin..yMax`). null points break the line. Drawn at the screen's pixel ratio.
"use strict";

class LinePlot {
  constructor(canvas, { series, span = 300, yMin = 0, yMax = 1, format = (v) => String(v) }) {
    this.canvas = canvas;
    this.series = series; // [{name, color}]
    this.span = span;
    this.yMin = yMin;
    this.yMax = yMax;
    this.format = format;
  }

  // Axis top at or above `v` whose quarters (the grid lines) are round: 1, 2, 4, 8 or 10 x 10^k.
  static niceCeil(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 4, 8, 10]) if (m * p >= v * (1 - 1e-9)) return m * p;
    return 10 * p;
  }

  // data: one array of [t, y] per series; now: the right edge (seconds).
  draw(data, now) {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth;
    const h = c.clientHeight;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(h * dpr);
    }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const style = getComputedStyle(document.documentElement);
    const ink = style.getPropertyValue("--muted").trim() || "#666";
    const line = style.getPropertyValue("--line").trim() || "#ddd";

    let top = this.yMax;
    for (const pts of data) for (const p of pts) if (p[1] !== null && p[1] > top) top = p[1];
    top = LinePlot.niceCeil(top);
    const left = 48, right = 8, up = 8, down = 18;
    const pw = w - left - right, ph = h - up - down;
    const x = (t) => left + pw * (1 - (now - t) / this.span);
    const y = (v) => up + ph * (1 - (v - this.yMin) / (top - this.yMin));

    g.font = "11px system-ui, sans-serif";
    g.fillStyle = ink;
    g.strokeStyle = line;
    g.lineWidth = 1;
    g.textAlign = "right";
    g.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const v = this.yMin + (top - this.yMin) * i / 4;
      const yy = Math.round(y(v)) + 0.5;
      g.beginPath();
      g.moveTo(left, yy);
      g.lineTo(w - right, yy);
      g.stroke();
      g.fillText(this.format(v), left - 4, yy);
    }
    g.textAlign = "center";
    g.textBaseline = "top";
    for (let s = 0; s < this.span; s += this.span / 5) { // the oldest label would hit the axis
      g.textAlign = s === 0 ? "right" : "center";
      g.fillText(s === 0 ? "now" : "-" + Math.round(s / 60 * 10) / 10 + " min", x(now - s),
        h - down + 4);
    }

    g.lineWidth = 1.6;
    g.lineJoin = "round";
    data.forEach((pts, i) => {
      g.strokeStyle = this.series[i].color;
      g.beginPath();
      let pen = false;
      for (const [t, v] of pts) {
        if (v === null || now - t > this.span) { pen = false; continue; }
        if (pen) g.lineTo(x(t), y(v));
        else g.moveTo(x(t), y(v));
        pen = true;
      }
      g.stroke();
      // a lone point (no neighbour to draw a line to) as a dot
      g.fillStyle = this.series[i].color;
      pts.forEach(([t, v], j) => {
        const before = j > 0 ? pts[j - 1][1] : null;
        const after = j + 1 < pts.length ? pts[j + 1][1] : null;
        if (v !== null && before === null && after === null && now - t <= this.span) {
          g.beginPath();
          g.arc(x(t), y(v), 2, 0, 2 * Math.PI);
          g.fill();
        }
      });
    });
  }
}
