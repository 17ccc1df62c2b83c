// relign report: the inference-time search section (relign/report_search.py). Inlined into the page.
// Like the rest of the page it never writes markup: only textContent, hidden, open and classes.
(function () {
  "use strict";
  const root = document.getElementById("search");
  if (!root) return;

  // accuracy-vs-budget chart: hovering a point reads it out under the chart
  const fig = document.getElementById("chart-sweep");
  if (fig) {
    const out = fig.querySelector(".readout");
    fig.querySelectorAll("circle.pt").forEach(function (c) {
      c.addEventListener("mouseenter", function () { out.textContent = c.dataset.label; c.classList.add("hot"); });
      c.addEventListener("mouseleave", function () { out.textContent = ""; c.classList.remove("hot"); });
    });
  }

  // per-problem results: which file (sweep cell) and which problems are shown
  const select = document.getElementById("search-file"), filter = document.getElementById("search-filter");
  const count = document.getElementById("search-count");
  function keep(p, f) {
    return f === "all" || (f === "correct" && p.dataset.correct === "1") || (f === "incorrect" && p.dataset.correct === "0")
      || (f === "tree" && p.dataset.tree === "1") || (f === "error" && p.dataset.error === "1");
  }
  function apply() {
    if (!select) return;
    const f = filter ? filter.value : "all";
    root.querySelectorAll(".search-cell").forEach(function (cell) {
      const on = cell.dataset.cell === select.value;
      cell.hidden = !on;
      if (!on) return;
      let shown = 0, total = 0;
      cell.querySelectorAll("details.sproblem").forEach(function (p) {
        const ok = keep(p, f);
        p.hidden = !ok; total++; if (ok) shown++;
      });
      if (count) count.textContent = shown + " of " + total + " problems shown";
    });
  }
  if (select) select.addEventListener("change", apply);
  if (filter) filter.addEventListener("change", apply);

  // a sweep table row opens its cell's problems
  root.querySelectorAll("#sweep-table tr[data-cell]").forEach(function (tr) {
    tr.addEventListener("click", function () {
      if (!select) return;
      select.value = tr.dataset.cell;
      apply();
      document.getElementById("search-results").scrollIntoView();
    });
  });

  // tree tools: expand all, collapse all, back to the chosen path
  root.querySelectorAll(".tree-tools button").forEach(function (b) {
    b.addEventListener("click", function () {
      const tree = b.closest(".tree"), act = b.dataset.act;
      tree.querySelectorAll("li.node > details").forEach(function (d) {
        d.open = act === "expand" || (act === "chosen" && d.parentElement.dataset.chosen === "1");
      });
    });
  });

  apply();
})();
