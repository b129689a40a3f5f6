// A small line plot on <canvas>: no library, no network. window.LossPlot.draw(canvas, series, opts)
// series: [{label, color, width, points: [[x, y], ...]}]; the first series is drawn last (on top).
"use strict";
(function () {
  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) { hi = lo + 1; }
    const raw = (hi - lo) / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || 10 * mag;
    const ticks = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-9 * step; t += step) ticks.push(+t.toFixed(10));
    return ticks;
  }

  function fmt(v) {
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 100) return v.toFixed(0);
    if (a >= 1) return v.toFixed(2).replace(/\.?0+$/, "");
    return v.toPrecision(2);
  }

  function draw(canvas, series, opts) {
    opts = opts || {};
    const dpr = window.devicePixelRatio || 1;
    const cssW = canvas.clientWidth || canvas.width, cssH = Math.round(cssW * 0.47);
    canvas.width = Math.round(cssW * dpr); canvas.height = Math.round(cssH * dpr);
    canvas.style.height = cssH + "px";
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, cssW, cssH);
    const pad = {l: 48, r: 12, t: 10, b: 30};
    const W = cssW - pad.l - pad.r, H = cssH - pad.t - pad.b;
    const pts = series.flatMap((s) => s.points).filter((p) => Number.isFinite(p[1]));
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = "#6b7785";
    if (!pts.length) {
      g.textAlign = "center";
      g.fillText(opts.empty || "no data yet", pad.l + W / 2, pad.t + H / 2);
      canvas.dataset.points = "0";
      return;
    }
    let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
    let y0 = Math.min(...pts.map((p) => p[1])), y1 = Math.max(...pts.map((p) => p[1]));
    if (x1 === x0) { x1 = x0 + 1; }
    const ypad = (y1 - y0) * 0.08 || Math.abs(y1) * 0.1 || 1;
    y0 = Math.max(0, y0 - ypad); y1 = y1 + ypad;
    const X = (x) => pad.l + ((x - x0) / (x1 - x0)) * W;
    const Y = (y) => pad.t + H - ((y - y0) / (y1 - y0)) * H;

    // grid + axis labels
    g.strokeStyle = "#e6ebf0"; g.lineWidth = 1;
    g.textAlign = "right"; g.textBaseline = "middle";
    for (const t of niceTicks(y0, y1, 5)) {
      g.beginPath(); g.moveTo(pad.l, Y(t)); g.lineTo(pad.l + W, Y(t)); g.stroke();
      g.fillText(fmt(t), pad.l - 6, Y(t));
    }
    g.textAlign = "center"; g.textBaseline = "top";
    for (const t of niceTicks(x0, x1, Math.min(8, Math.max(1, x1 - x0)))) {
      if (!Number.isInteger(t)) continue;
      g.fillText(String(t), X(t), pad.t + H + 6);
    }
    g.strokeStyle = "#9aa7b4";
    g.beginPath(); g.moveTo(pad.l, pad.t); g.lineTo(pad.l, pad.t + H); g.lineTo(pad.l + W, pad.t + H); g.stroke();
    g.fillText(opts.xlabel || "step", pad.l + W / 2, pad.t + H + 17);

    // lines, the first series on top
    for (const s of series.slice().reverse()) {
      const p = s.points.filter((q) => Number.isFinite(q[1]));
      if (!p.length) continue;
      g.strokeStyle = s.color; g.fillStyle = s.color; g.lineWidth = s.width || 1.5;
      g.beginPath();
      p.forEach((q, i) => (i ? g.lineTo(X(q[0]), Y(q[1])) : g.moveTo(X(q[0]), Y(q[1]))));
      g.stroke();
      if (p.length === 1 || s.dots) p.forEach((q) => { g.beginPath(); g.arc(X(q[0]), Y(q[1]), 2.5, 0, 7); g.fill(); });
    }
    canvas.dataset.points = String(series.length ? series[0].points.length : 0);
  }

  window.LossPlot = {draw, niceTicks};
})();
