// A small line plot on <canvas>: no library, no network. window.LossPlot.draw(canvas, series, opts)
// series: [{label, color, width, points: [[x, y], ...], line (default true), dots, alpha}]; the first
// series is drawn last (on top); a series with dash: [on, off] is dashed. opts: {xlabel, ylabel,
// xInteger, empty, bands: [[x0, x1], ...] shaded behind the series, bandColor}. LossPlot.ema(ys, s) smooths.
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

  // Exponential moving average with the start-up bias removed (the first points are not pulled
  // towards 0), as TensorBoard smooths scalars; s = 0 returns the values unchanged.
  function ema(ys, s) {
    let acc = 0, w = 0;
    return ys.map((y) => { acc = s * acc + (1 - s) * y; w = s * w + (1 - s); return acc / w; });
  }

  function draw(canvas, series, opts) {
    opts = opts || {};
    const dpr = window.devicePixelRatio || 1;
    const cssW = canvas.clientWidth || canvas.width, cssH = Math.round(cssW * 0.5);
    canvas.width = Math.round(cssW * dpr); canvas.height = Math.round(cssH * dpr);
    canvas.style.height = cssH + "px";
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, cssW, cssH);
    const pad = {l: 60, r: 12, t: 10, b: 40};
    const W = cssW - pad.l - pad.r, H = cssH - pad.t - pad.b;
    const pts = series.flatMap((s) => s.points).filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1]));
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = "#6b7785";
    canvas.dataset.xlabel = opts.xlabel || "step";
    canvas.dataset.ylabel = opts.ylabel || "loss";
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

    // grid, tick labels and axis titles
    g.strokeStyle = "#e6ebf0"; g.lineWidth = 1;
    g.textAlign = "right"; g.textBaseline = "middle";
    for (const t of niceTicks(y0, y1, 5)) {
      g.beginPath(); g.moveTo(pad.l, Y(t)); g.lineTo(pad.l + W, Y(t)); g.stroke();
      g.fillText(fmt(t), pad.l - 6, Y(t));
    }
    g.textAlign = "center"; g.textBaseline = "top";
    const xcount = opts.xInteger === false ? 8 : Math.min(8, Math.max(1, x1 - x0));
    for (const t of niceTicks(x0, x1, xcount)) {
      if (opts.xInteger !== false && !Number.isInteger(t)) continue;
      g.fillText(fmt(t), X(t), pad.t + H + 6);
    }
    g.strokeStyle = "#9aa7b4";
    g.beginPath(); g.moveTo(pad.l, pad.t); g.lineTo(pad.l, pad.t + H); g.lineTo(pad.l + W, pad.t + H); g.stroke();
    // shaded x ranges (e.g. the time of a fault), clipped to the plot
    g.fillStyle = opts.bandColor || "rgba(208, 79, 122, 0.16)";
    let bands = 0;
    for (const [b0, b1] of opts.bands || []) {
      const l = Math.max(x0, b0), r = Math.min(x1, b1);
      if (r > l) { g.fillRect(X(l), pad.t, Math.max(1, X(r) - X(l)), H); bands++; }
    }
    canvas.dataset.bands = String(bands);
    g.fillStyle = "#1d2733"; g.font = "12px system-ui, sans-serif";
    g.fillText(canvas.dataset.xlabel, pad.l + W / 2, pad.t + H + 22);
    g.save(); g.translate(14, pad.t + H / 2); g.rotate(-Math.PI / 2);
    g.textBaseline = "middle"; g.fillText(canvas.dataset.ylabel, 0, 0); g.restore();

    // series, the first on top
    for (const s of series.slice().reverse()) {
      const p = s.points.filter((q) => Number.isFinite(q[0]) && Number.isFinite(q[1]));
      if (!p.length) continue;
      g.globalAlpha = s.alpha ?? 1;
      g.strokeStyle = s.color; g.fillStyle = s.color; g.lineWidth = s.width || 1.5;
      if (s.line !== false) {
        g.setLineDash(s.dash || []);
        g.beginPath();
        p.forEach((q, i) => (i ? g.lineTo(X(q[0]), Y(q[1])) : g.moveTo(X(q[0]), Y(q[1]))));
        g.stroke();
        g.setLineDash([]);
      }
      if (p.length === 1 || s.dots) {
        const r = s.dotRadius || 2.2;
        p.forEach((q) => { g.beginPath(); g.arc(X(q[0]), Y(q[1]), r, 0, 7); g.fill(); });
      }
      g.globalAlpha = 1;
    }
    canvas.dataset.points = String(series.length ? series[0].points.length : 0);
  }

  window.LossPlot = {draw, niceTicks, ema};
})();
