// trajgate UI: draws the run page's SVG charts from the JSON the server embedded, and keeps them live from the
// run's step event stream. No library, no build step.
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const dataNode = document.getElementById("run-data");
  if (!dataNode) return;
  const data = JSON.parse(dataNode.textContent);

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }
  function finite(v) { return typeof v === "number" && isFinite(v); }
  function fmt(v, d) { return finite(v) ? v.toFixed(d === undefined ? 3 : d) : "–"; }

  // A frame with axes and ticks over [x0, x1] x [y0, y1]; returns the svg and the scales.
  function frame(container, width, height, xs, ys) {
    container.textContent = "";
    const svg = el("svg", { width: width, height: height, viewBox: `0 0 ${width} ${height}` }, container);
    const pad = { l: 44, r: 10, t: 8, b: 20 };
    let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
    let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
    const sx = (x) => pad.l + (x - x0) / (x1 - x0) * (width - pad.l - pad.r);
    const sy = (y) => height - pad.b - (y - y0) / (y1 - y0) * (height - pad.t - pad.b);
    el("line", { class: "axis", x1: pad.l, y1: height - pad.b, x2: width - pad.r, y2: height - pad.b }, svg);
    el("line", { class: "axis", x1: pad.l, y1: pad.t, x2: pad.l, y2: height - pad.b }, svg);
    for (const y of [y0, (y0 + y1) / 2, y1]) {
      el("text", { class: "tick", x: pad.l - 4, y: sy(y) + 3, "text-anchor": "end" }, svg).textContent = Math.abs(y) >= 1000 ? y.toFixed(0) : y.toPrecision(3);
    }
    for (const x of [x0, x1]) {
      el("text", { class: "tick", x: sx(x), y: height - 6, "text-anchor": "middle" }, svg).textContent = String(Math.round(x));
    }
    return { svg, sx, sy };
  }
  function empty(container, width, height, text) {
    container.textContent = "";
    const svg = el("svg", { width: width, height: height }, container);
    el("text", { class: "empty", x: 10, y: height / 2 }, svg).textContent = text;
  }
  function title(node, text) { el("title", {}, node).textContent = text; }

  function drawReward(container) {
    const width = Math.max(480, Math.min(980, container.clientWidth || 900)), height = 260;
    const train = data.steps.filter((s) => finite(s.metrics.reward_mean));
    const evals = data.eval.filter((e) => finite(e.mean_reward));
    if (!train.length && !evals.length) return empty(container, width, height, "no steps or eval rewards yet");
    const xs = train.map((s) => s.step).concat(evals.map((e) => e.policy_version));
    const ys = [];
    for (const s of train) { const sd = finite(s.metrics.reward_std) ? s.metrics.reward_std : 0; ys.push(s.metrics.reward_mean - sd, s.metrics.reward_mean + sd); }
    for (const e of evals) ys.push(e.ci_low, e.ci_high);
    const { svg, sx, sy } = frame(container, width, height, xs, ys);
    if (train.length) {
      const sd = (s) => (finite(s.metrics.reward_std) ? s.metrics.reward_std : 0);
      const upper = train.map((s) => `${sx(s.step)},${sy(s.metrics.reward_mean + sd(s))}`);
      const lower = train.slice().reverse().map((s) => `${sx(s.step)},${sy(s.metrics.reward_mean - sd(s))}`);
      el("polygon", { class: "band", points: upper.concat(lower).join(" ") }, svg);
      el("polyline", { class: "line", points: train.map((s) => `${sx(s.step)},${sy(s.metrics.reward_mean)}`).join(" ") }, svg);
      for (const s of train) {
        const dot = el("circle", { class: "pt train", cx: sx(s.step), cy: sy(s.metrics.reward_mean), r: 3, "data-step": s.step }, svg);
        title(dot, `step ${s.step}: reward ${fmt(s.metrics.reward_mean)} ± ${fmt(s.metrics.reward_std)}`);
      }
    }
    if (evals.length) {
      el("polyline", { class: "eval-line", points: evals.map((e) => `${sx(e.policy_version)},${sy(e.mean_reward)}`).join(" ") }, svg);
      for (const e of evals) {
        el("line", { class: "ci", x1: sx(e.policy_version), x2: sx(e.policy_version), y1: sy(e.ci_low), y2: sy(e.ci_high) }, svg);
        const dot = el("circle", { class: "pt eval", cx: sx(e.policy_version), cy: sy(e.mean_reward), r: 4, "data-version": e.policy_version }, svg);
        title(dot, `eval on version ${e.policy_version}: ${fmt(e.mean_reward)} [${fmt(e.ci_low)}, ${fmt(e.ci_high)}], n=${e.trajectories}`);
      }
    }
  }

  function drawMetric(container) {
    const key = container.dataset.metric, width = 300, height = 130;
    const points = data.steps.filter((s) => finite(s.metrics[key]));
    if (!points.length) return empty(container, width, height, "no data");
    const { svg, sx, sy } = frame(container, width, height, points.map((s) => s.step), points.map((s) => s.metrics[key]));
    el("polyline", { class: "line", points: points.map((s) => `${sx(s.step)},${sy(s.metrics[key])}`).join(" ") }, svg);
    for (const s of points) {
      const dot = el("circle", { class: "pt", cx: sx(s.step), cy: sy(s.metrics[key]), r: 2.2 }, svg);
      title(dot, `step ${s.step}: ${key} ${fmt(s.metrics[key], 4)}`);
    }
  }

  function drawAll() {
    for (const node of document.querySelectorAll(".chart")) {
      if (node.dataset.kind === "reward") drawReward(node); else drawMetric(node);
    }
  }

  function addRow(step) {
    const body = document.querySelector("#steps-table tbody");
    const m = step.metrics;
    const reasons = m.drop_reasons ? Object.entries(m.drop_reasons).map(([k, v]) => `${k}: ${v}`).join(", ") : "";
    // The objective's columns, as the page drew them (ratio and clip, token accuracy, reverse KL ...).
    const objective = data.columns.map(([key, digits]) => fmt(m[key], digits));
    const last = m.objective === "sft_data" ? `sft data ${m.sft_data}, epoch ${m.epoch}`
      : (m.groups_dropped ?? "–") + (reasons ? ` (${reasons})` : "");
    const cells = [step.step, fmt(m.reward_mean), fmt(m.reward_std), fmt(m.loss, 4), ...objective,
      fmt(m.grad_norm), fmt(m.tokens_per_s, 0), fmt(m.merge_ratio, 2), m.groups_used ?? "–", last];
    const row = document.createElement("tr");
    row.dataset.step = step.step;
    cells.forEach((text, i) => { const td = document.createElement("td"); if (i < cells.length - 1) td.className = "num"; td.textContent = String(text); row.appendChild(td); });
    body.insertBefore(row, body.firstChild);
  }

  drawAll();
  window.addEventListener("resize", drawAll);

  // Live: every step the trainer commits after the last one shown.
  if (window.EventSource) {
    const last = data.steps.length ? data.steps[data.steps.length - 1].step : -1;
    const status = document.getElementById("live-status");
    const source = new EventSource(`/ui/events?run=${encodeURIComponent(data.run)}&after=${last}`);
    source.onopen = () => { status.textContent = "live"; };
    source.onerror = () => { status.textContent = "reconnecting…"; };
    source.onmessage = (event) => {
      const step = JSON.parse(event.data);
      if (data.steps.length && step.step <= data.steps[data.steps.length - 1].step) return;
      data.steps.push({ step: step.step, metrics: step.metrics || {} });
      addRow({ step: step.step, metrics: step.metrics || {} });
      drawAll();
    };
  }
})();
