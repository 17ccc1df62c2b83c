// relign report: the page's behaviour (chart readouts, the trace browser). relign/report/page.py
// inlines this file. Data reaches the DOM only through textContent / setAttribute, never as
// markup: model output cannot become elements.
"use strict";
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}
function num(v) {
  if (v === null || v === undefined) return "—";
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  return (a >= 1e6 || (a < 1e-3 && a > 0)) ? v.toExponential(3) : String(+v.toPrecision(4));
}

// ---- hover readout on every line chart (a bar chart has no data-points): nearest logged step of each series
document.querySelectorAll("figure.chart[data-points]").forEach(function (fig) {
  const svg = fig.querySelector("svg"), readout = fig.querySelector(".readout");
  const cursor = svg.querySelector(".cursor"), g = JSON.parse(fig.dataset.points);
  svg.addEventListener("mousemove", function (ev) {
    const r = svg.getBoundingClientRect(), vb = svg.viewBox.baseVal;
    const px = (ev.clientX - r.left) * vb.width / r.width;
    const x = g.x0 + (px - g.left) / g.width * (g.x1 - g.x0);
    const parts = [];
    let best = null;
    g.series.forEach(function (s) {
      let i = 0;
      for (let j = 1; j < s.x.length; j++) if (Math.abs(s.x[j] - x) < Math.abs(s.x[i] - x)) i = j;
      if (best === null) best = s.x[i];
      parts.push(s.key + " " + num(s.y[i]));
    });
    readout.textContent = "step " + num(best) + ": " + parts.join(" · ");
    const cx = g.left + (best - g.x0) / (g.x1 - g.x0) * g.width;
    cursor.setAttribute("x1", cx); cursor.setAttribute("x2", cx); cursor.setAttribute("visibility", "visible");
  });
  svg.addEventListener("mouseleave", function () { readout.textContent = ""; cursor.setAttribute("visibility", "hidden"); });
});

// ---- trace browser
(function () {
  const dataEl = document.getElementById("trace-data");
  if (!dataEl) return;
  const data = JSON.parse(dataEl.textContent);
  const list = document.getElementById("step-list"), view = document.getElementById("trace-view");
  const filterEl = document.getElementById("trace-filter"), searchEl = document.getElementById("trace-search");
  const shadeEl = document.getElementById("trace-shade"), countEl = document.getElementById("trace-count");
  const noteEl = document.getElementById("shade-note");
  let current = null;

  data.steps.forEach(function (s, i) {
    let label = "step " + s.step;
    if (s.mean_reward !== null) label += " · r " + num(s.mean_reward);
    if (s.accuracy !== null) label += " · " + Math.round(100 * s.accuracy) + "%";
    const b = el("button", "step-btn", label);
    b.type = "button";
    b.dataset.step = s.step;
    b.addEventListener("click", function () { show(i); });
    list.appendChild(b);
  });

  function shadeStyle(row, j, mode, scale) {
    if (row.token_mask && row.token_mask[j] === 0) return null;
    if (mode === "advantage" && row.token_advantages) {
      const a = row.token_advantages[j];
      if (a === null || scale === 0) return null;
      const alpha = Math.min(1, Math.abs(a) / scale) * 0.55;
      return a >= 0 ? "rgba(22,163,74," + alpha + ")" : "rgba(220,38,38," + alpha + ")";
    }
    if (mode === "logp" && row.logps) {
      const lp = row.logps[j];
      if (lp === null) return null;
      return "rgba(234,88,12," + ((1 - Math.exp(lp)) * 0.7).toFixed(3) + ")";  // unlikely tokens stand out
    }
    return null;
  }

  function tokensView(row, mode, scale) {
    const box = el("div", "tokens");
    if (!row.tokens || row.tokens.length === 0) { box.textContent = row.response; return box; }
    row.tokens.forEach(function (t, j) {
      const span = el("span", "tok", t);
      if (row.token_mask && row.token_mask[j] === 0) span.classList.add("env");
      const bg = shadeStyle(row, j, mode, scale);
      if (bg) span.style.background = bg;
      const tip = [];
      if (row.logps) {
        const lp = row.logps[j];
        tip.push(lp === null ? "logp unknown" : "logp " + num(lp) + " (p " + num(Math.exp(lp)) + ")");
      }
      if (row.token_advantages) tip.push("advantage " + num(row.token_advantages[j]));
      if (row.token_mask && row.token_mask[j] === 0) tip.push("not trained (environment/tool text)");
      span.title = tip.join(" · ");
      box.appendChild(span);
    });
    if (row.tokens_cut > 0) {  // the rest as text: token detail stops at max_tokens
      box.appendChild(el("span", "note", " … " + row.tokens_cut + " more tokens"));
      const full = el("details");
      full.appendChild(el("summary", null, "whole response as text"));
      full.appendChild(el("pre", null, row.response));
      box.appendChild(full);
    }
    return box;
  }

  function rowView(row, k, mode, scale) {
    const div = el("div", "trace-row");
    const truncated = row.finish_reason === "length";
    div.dataset.correct = row.correct === null ? "" : (row.correct ? "1" : "0");
    div.dataset.truncated = truncated ? "1" : "0";
    const text = row.response || (row.tokens || []).join("");
    div.dataset.search = (data_step().prompts[row.prompt_id] + "\n" + text).toLowerCase();
    const meta = el("div", "meta");
    meta.appendChild(el("b", null, "#" + k + " "));
    if (row.correct !== null) {
      const word = row.correct ? "correct" : "incorrect";
      meta.appendChild(el("span", "badge " + word, word));
    }
    if (truncated) meta.appendChild(el("span", "badge truncated", "truncated"));
    const facts = ["reward " + num(row.reward)];
    if (row.score !== null) facts.push("score " + num(row.score));
    facts.push("advantage " + num(row.advantage));
    if (row.length !== null && row.length !== undefined) facts.push(row.length + " tokens");
    facts.push("finish " + row.finish_reason);
    if (row.extracted !== null && row.extracted !== undefined) facts.push("answer " + JSON.stringify(row.extracted));
    if (row.gold !== null && row.gold !== undefined) facts.push("gold " + JSON.stringify(row.gold));
    Object.keys(row.components || {}).forEach(function (c) { facts.push(c + " " + num(row.components[c])); });
    meta.appendChild(el("span", null, " " + facts.join(" · ")));
    div.appendChild(meta);
    div.appendChild(tokensView(row, mode, scale));
    return div;
  }

  function data_step() { return data.steps[current]; }

  function render() {
    const s = data_step(), mode = shadeEl.value;
    let scale = 0;  // one colour scale per step: shades compare across its responses
    s.rows.forEach(function (r) {
      (r.token_advantages || []).forEach(function (a) { if (a !== null) scale = Math.max(scale, Math.abs(a)); });
    });
    noteEl.textContent = !s.token_detail ? "No token detail embedded for this step: the responses as text." : {
      advantage: "Green: positive advantage, red: negative (darker = larger |A|, full at ±" + num(scale) + "). "
        + "Grey italic: environment/tool tokens (not trained). Hover a token for its numbers.",
      logp: "Orange: tokens the sampler found unlikely (darker = lower probability). Hover a token for its numbers.",
    }[mode] || "";
    const groups = [];
    s.rows.forEach(function (r, k) {
      let g = groups[r.prompt_id];
      if (!g) {
        g = groups[r.prompt_id] = el("div", "trace-group");
        const d = el("details", "prompt");
        const text = s.problems[r.prompt_id] || s.prompts[r.prompt_id];
        d.appendChild(el("summary", null, "Prompt " + (r.prompt_id + 1) + ": " + text.slice(0, 120).replace(/\s+/g, " ")));
        d.appendChild(el("pre", null, s.prompts[r.prompt_id]));
        g.appendChild(d);
      }
      g.appendChild(rowView(r, k, mode, scale));
    });
    view.replaceChildren.apply(view, groups.filter(Boolean));
    view.dataset.step = s.step;
    applyFilter();
  }

  function applyFilter() {
    const f = filterEl.value, q = searchEl.value.trim().toLowerCase();
    let shown = 0, total = 0;
    view.querySelectorAll(".trace-group").forEach(function (g) {
      let any = false;
      g.querySelectorAll(".trace-row").forEach(function (r) {
        const ok = (f === "all" || (f === "correct" && r.dataset.correct === "1") || (f === "incorrect" && r.dataset.correct === "0")
          || (f === "truncated" && r.dataset.truncated === "1")) && (!q || r.dataset.search.indexOf(q) >= 0);
        r.hidden = !ok; total++; if (ok) { shown++; any = true; }
      });
      g.hidden = !any;
    });
    const s = data_step();
    countEl.textContent = shown + " of " + total + " responses shown"
      + (s.total_rows > s.rows.length ? " (" + s.total_rows + " in the file)" : "");
  }

  function show(i) {
    current = i;
    list.querySelectorAll(".step-btn").forEach(function (b, j) {
      b.classList.toggle("active", j === i);
      b.setAttribute("aria-pressed", j === i ? "true" : "false");
    });
    render();
  }

  filterEl.addEventListener("change", applyFilter);
  searchEl.addEventListener("input", applyFilter);
  shadeEl.addEventListener("change", render);
  if (data.steps.length) show(data.steps.length - 1);
})();
