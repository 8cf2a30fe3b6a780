/* The orchestrator's dashboard: the fleet and one job's cost, prices, nodes, training and
 * events (data contract: CONTRACT.md next to this file).
 *
 * Live mode (served by the controller): polls v1/dashboard and v1/jobs/{id}/dashboard every
 * second. Report mode (orchestrator report, simulate --plot): reads the JSON embedded in
 * <script id="dashboard-data">. No libraries, no network beyond the controller, text set with
 * textContent only. Tests read body.dataset.state/job/renderedAt and the data-testid hooks.
 */
(function () {
  "use strict";

  var POLL_MS = 1000;
  var SVG = "http://www.w3.org/2000/svg";
  var PALETTE = ["#2563eb", "#d97706", "#059669", "#7c3aed", "#db2777", "#0891b2", "#65a30d",
                 "#b91c1c"];
  var MARGIN = { left: 58, right: 52, top: 10, bottom: 24 };

  var embedded = null;  // the report's data (report mode), read by start()
  var state = { fleet: null, page: null, job: null, timer: null, asked: 0 };

  // ---- formatting

  function usd(v) {
    if (v === null || v === undefined) return "—";
    var a = Math.abs(v);
    if (a === 0) return "$0";
    if (a < 0.01) return "$" + v.toPrecision(2);
    if (a < 1000) return "$" + v.toFixed(2);
    return "$" + Math.round(v).toLocaleString("en-US");
  }

  function num(v, digits) {
    if (v === null || v === undefined) return "—";
    if (digits !== undefined) return v.toFixed(digits);
    return Math.abs(v) >= 1000 ? Math.round(v).toLocaleString("en-US") : String(+v.toPrecision(4));
  }

  function pad(n) { return n < 10 ? "0" + n : String(n); }

  function clock(t, withDate) {
    var d = new Date(t * 1000);
    var hm = pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes());
    if (!withDate) return hm;
    return d.getUTCFullYear() + "-" + pad(d.getUTCMonth() + 1) + "-" + pad(d.getUTCDate()) + " " + hm;
  }

  function stamp(t) {
    var d = new Date(t * 1000);
    return clock(t, true) + ":" + pad(d.getUTCSeconds());
  }

  // ---- DOM helpers

  function $(id) { return document.getElementById(id); }

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    setAttrs(node, attrs);
    if (text !== undefined && text !== null) node.textContent = text;
    return node;
  }

  function svgEl(tag, attrs, text) {
    var node = document.createElementNS(SVG, tag);
    setAttrs(node, attrs);
    if (text !== undefined && text !== null) node.textContent = text;
    return node;
  }

  function setAttrs(node, attrs) {
    if (!attrs) return;
    Object.keys(attrs).forEach(function (k) {
      if (attrs[k] !== undefined && attrs[k] !== null) node.setAttribute(k, String(attrs[k]));
    });
  }

  function titled(node, text) {
    node.appendChild(svgEl("title", null, text));
    return node;
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  function legend(id, items) {
    var box = $(id);
    clear(box);
    items.forEach(function (item) {
      var key = el("span", { "class": "key" });
      key.appendChild(el("i", { style: "background:" + item.color + (item.dashed ? ";opacity:.6" : "") }));
      key.appendChild(document.createTextNode(item.label));
      box.appendChild(key);
    });
  }

  // ---- scales and axes

  function niceStep(span, count) {
    var raw = span / Math.max(1, count);
    var mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var steps = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < steps.length; i++) if (steps[i] * mag >= raw) return steps[i] * mag;
    return 10 * mag;
  }

  function timeStep(span) {
    var steps = [60, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800];
    for (var i = 0; i < steps.length; i++) if (span / steps[i] <= 6) return steps[i];
    return steps[steps.length - 1] * Math.ceil(span / (6 * steps[steps.length - 1]));
  }

  /** A plot area on `svg`: x is time over `xDomain`, y over [0, yMax] (or [yMin, yMax]). */
  function plot(svg, xDomain, yDomain, yFormat) {
    clear(svg);
    var width = svg.clientWidth || 560;
    var height = svg.clientHeight || 210;
    svg.setAttribute("viewBox", "0 0 " + width + " " + height);
    var x0 = MARGIN.left, x1 = width - MARGIN.right, y0 = height - MARGIN.bottom, y1 = MARGIN.top;
    var tSpan = Math.max(1e-9, xDomain[1] - xDomain[0]);
    var vSpan = Math.max(1e-12, yDomain[1] - yDomain[0]);
    var p = {
      svg: svg, width: width, height: height, left: x0, right: x1, bottom: y0, top: y1,
      x: function (t) { return x0 + (x1 - x0) * (t - xDomain[0]) / tSpan; },
      y: function (v) { return y0 - (y0 - y1) * (v - yDomain[0]) / vSpan; },
      xDomain: xDomain, yDomain: yDomain,
    };
    var grid = svgEl("g", { "class": "grid" });
    if (yFormat) {
      var step = niceStep(vSpan, 4);
      for (var v = Math.ceil(yDomain[0] / step) * step; v <= yDomain[1] + 1e-12; v += step) {
        grid.appendChild(svgEl("line", { x1: x0, x2: x1, y1: p.y(v), y2: p.y(v) }));
        grid.appendChild(svgEl("text", { x: x0 - 6, y: p.y(v) + 4, "class": "tick y" }, yFormat(v)));
      }
    }
    var tStep = timeStep(tSpan);
    var withDate = tSpan > 2 * 86400;
    for (var t = Math.ceil(xDomain[0] / tStep) * tStep; t <= xDomain[1]; t += tStep) {
      grid.appendChild(svgEl("line", { x1: p.x(t), x2: p.x(t), y1: y1, y2: y0, "class": "v" }));
      grid.appendChild(svgEl("text", { x: p.x(t), y: y0 + 16, "class": "tick x" }, clock(t, withDate)));
    }
    grid.appendChild(svgEl("line", { x1: x0, x2: x1, y1: y0, y2: y0, "class": "axis" }));
    svg.appendChild(grid);
    return p;
  }

  function linePath(p, points, step) {
    var d = "";
    points.forEach(function (pt, i) {
      if (pt[1] === null || pt[1] === undefined || !isFinite(pt[1])) return;
      var t = Math.min(Math.max(pt[0], p.xDomain[0]), p.xDomain[1]);  // stay inside the plot
      var x = p.x(t).toFixed(1), y = p.y(pt[1]).toFixed(1);
      if (d === "") d = "M" + x + "," + y;
      else if (step) d += "H" + x + "V" + y;
      else d += "L" + x + "," + y;
    });
    return d;
  }

  function series(p, name, points, attrs, step) {
    var a = Object.assign({ d: linePath(p, points, step), "data-series": name, "class": "line " + name }, attrs || {});
    var path = svgEl("path", a);
    p.svg.appendChild(path);
    return path;
  }

  function emptyNote(p, text) {
    p.svg.appendChild(svgEl("text", {
      x: (p.left + p.right) / 2, y: (p.top + p.bottom) / 2, "class": "empty",
    }, text));
  }

  function maxOf(values, floor) {
    var m = floor;
    values.forEach(function (v) { if (v !== null && v !== undefined && isFinite(v) && v > m) m = v; });
    return m;
  }

  // ---- the job's time range

  function timeDomain(page) {
    var lo = Infinity, hi = -Infinity;
    function see(t) { if (t !== null && t !== undefined) { lo = Math.min(lo, t); hi = Math.max(hi, t); } }
    page.spend.forEach(function (s) { see(s.t); });
    page.nodes.forEach(function (n) { see(n.launched_at); see(n.ended_at); });
    page.marks.forEach(function (m) { see(m.t); });
    page.training.forEach(function (r) { see(r.t); });
    if (page.job.state === "running" || page.job.state === "queued") see(page.now_s);
    if (!isFinite(lo)) { lo = page.now_s - 60; hi = page.now_s; }
    if (hi - lo < 60) hi = lo + 60;
    return [lo, hi];
  }

  // ---- the panels

  function renderCards(job) {
    function card(testid, value, text) {
      var node = document.querySelector('[data-testid="' + testid + '"]');
      node.setAttribute("data-value", value === null || value === undefined ? "" : String(value));
      node.querySelector(".value").textContent = text;
    }
    card("spent", job.spent_usd, usd(job.spent_usd));
    card("budget", job.budget_usd, usd(job.budget_usd));
    card("projected", job.projected_cost_usd, usd(job.projected_cost_usd));
    card("cost-per-work", job.cost_per_work_usd, usd(job.cost_per_work_usd));
    card("evictions", job.evictions, String(job.evictions));
    card("nodes-reliable", job.nodes_alive.reliable, String(job.nodes_alive.reliable));
    card("nodes-transient", job.nodes_alive.transient, String(job.nodes_alive.transient));
    card("iterations", job.iterations, num(job.iterations));
    card("loss", job.loss, job.loss === null ? "—" : num(job.loss));

    var share = job.budget_usd > 0 ? (100 * job.spent_usd / job.budget_usd) : 0;
    $("spent-sub").textContent = share.toFixed(1) + "% of the budget";
    var over = job.projected_cost_usd !== null && job.projected_cost_usd > job.budget_usd;
    document.querySelector('[data-testid="projected"]').classList.toggle("alarm", over);
    $("budget-sub").textContent = job.budget_usd >= job.spent_usd
      ? usd(job.budget_usd - job.spent_usd) + " left" : "over budget";
    $("cpw-sub").textContent = "expected " + usd(job.expected_cost_per_work_usd);
    var ended = ["succeeded", "failed", "budget_exhausted", "cancelled"].indexOf(job.state) >= 0;
    var at = job.projected_finish_at === null || job.projected_finish_at === undefined ? null
      : new Date(job.projected_finish_at * 1000).toISOString().slice(0, 16).replace("T", " ");
    $("projected-sub").textContent = at === null ? "BidBrain's expected cost at completion"
      : (ended ? "what it cost; ended " : "done around ") + at + " UTC";
    $("evictions-sub").textContent = job.launch_failures + " launch failure" +
      (job.launch_failures === 1 ? "" : "s");
    var done = job.work_gpu_hours > 0 ? 100 * job.work_done_gpu_hours / job.work_gpu_hours : 0;
    $("iterations-sub").textContent = "work " + done.toFixed(1) + "% done";
  }

  function renderSpend(page, dom) {
    var svg = document.querySelector('[data-testid="chart-spend"]');
    var budget = page.job.budget_usd;
    var yMax = maxOf(page.spend.map(function (s) { return Math.max(s.spent_usd || 0, s.projected_cost_usd || 0); }),
      budget) * 1.08;
    var p = plot(svg, dom, [0, yMax || 1], usd);
    series(p, "budget", [[dom[0], budget], [dom[1], budget]]);
    series(p, "projection", page.spend.map(function (s) { return [s.t, s.projected_cost_usd]; }), null, true);
    series(p, "spent", page.spend.map(function (s) { return [s.t, s.spent_usd]; }));
    if (!page.spend.length) emptyNote(p, "no BidBrain decision yet");
    legend("legend-spend", [
      { label: "spent", color: "#2563eb" }, { label: "projected total", color: "#7c3aed", dashed: true },
      { label: "budget", color: "#dc2626", dashed: true },
    ]);
  }

  function renderCostPerWork(page, dom) {
    var svg = document.querySelector('[data-testid="chart-cost-per-work"]');
    var actual = page.spend.map(function (s) {
      return [s.t, s.work_done_gpu_hours > 0 ? s.spent_usd / s.work_done_gpu_hours : null];
    });
    var expected = page.spend.map(function (s) { return [s.t, s.expected_cost_per_work_usd]; });
    var yMax = maxOf(actual.concat(expected).map(function (pt) { return pt[1]; }), 0) * 1.1;
    var p = plot(svg, dom, [0, yMax || 1], usd);
    series(p, "expected-cost-per-work", expected, null, true);
    series(p, "cost-per-work", actual);
    if (!actual.some(function (pt) { return pt[1] !== null; })) {
      emptyNote(p, page.spend.length && page.spend.every(function (s) { return s.work_done_gpu_hours === null; })
        ? "work done over time is not recorded in this run" : "no work done yet");
    }
    legend("legend-cost-per-work", [
      { label: "so far (spent / work done)", color: "#2563eb" },
      { label: "BidBrain's expectation", color: "#059669", dashed: true },
    ]);
  }

  /** The step series `points` cut to [from, to]: the price in force at `from`, then changes. */
  function stepSlice(points, from, to) {
    var out = [];
    points.forEach(function (pt) {
      if (pt[0] <= from) out = [[from, pt[1]]];
      else if (pt[0] <= to) out.push(pt);
    });
    if (out.length) out.push([to, out[out.length - 1][1]]);
    return out;
  }

  function renderPrices(page, dom) {
    var svg = document.querySelector('[data-testid="chart-prices"]');
    var yMax = maxOf([].concat.apply([], page.prices.map(function (m) {
      return m.points.map(function (pt) { return pt[1]; });
    })), 0) * 1.1;
    var p = plot(svg, dom, [0, yMax || 1], usd);
    // a colour for every market the job held at some time; the rest stay grey
    var spans = page.nodes.filter(function (n) { return n.tier === "transient"; });
    var used = {};
    spans.forEach(function (n) { used[n.instance_type + "@" + n.zone] = true; });
    var colors = {}, keys = [], others = 0;
    page.prices.forEach(function (m) {
      if (m.held || used[m.market]) {
        colors[m.market] = PALETTE[keys.length % PALETTE.length];
        keys.push({ label: m.market + (m.held ? " (held)" : ""), color: colors[m.market] });
      } else {
        others += 1;
      }
    });
    var order = page.prices.filter(function (m) { return !colors[m.market]; })
      .concat(page.prices.filter(function (m) { return colors[m.market]; }));  // coloured on top
    order.forEach(function (m) {
      var points = m.points.slice();
      if (points.length) points.push([dom[1], points[points.length - 1][1]]);
      var color = colors[m.market];
      var path = series(p, "price", points, {
        "data-market": m.market, "data-held": m.held ? "true" : "false",
        "class": "line price" + (m.held ? " held" : color ? " used" : ""),
        style: color ? "stroke:" + color : null,
      }, true);
      titled(path, m.market + (m.held ? " (held)" : ""));
    });
    var byMarket = {};
    page.prices.forEach(function (m) { byMarket[m.market] = m; });
    spans.forEach(function (n) {  // thick where the job held an instance in the market
      var market = byMarket[n.instance_type + "@" + n.zone];
      if (!market) return;
      var to = n.ended_at === null ? dom[1] : n.ended_at;
      var span = series(p, "held-span", stepSlice(market.points, n.launched_at, to), {
        "class": "line held-span", style: "stroke:" + colors[market.market],
      }, true);
      titled(span, n.instance_id + " held " + market.market);
    });
    if (!page.prices.length) emptyNote(p, "no prices recorded yet");
    legend("legend-prices", keys.concat(others ? [{ label: others + " other market" +
      (others === 1 ? "" : "s") + " considered", color: "#cbd5e1" }] : [])
      .concat(spans.length ? [{ label: "thick: while held", color: "transparent" }] : []));
  }

  function renderNodes(page, dom) {
    var svg = document.querySelector('[data-testid="chart-nodes"]');
    var nodes = page.nodes.filter(function (n) { return n.tier === "reliable"; })
      .concat(page.nodes.filter(function (n) { return n.tier !== "reliable"; }));
    var failures = page.marks.filter(function (m) { return m.kind === "launch_failed"; });
    var rows = nodes.length + (failures.length ? 1 : 0);
    svg.style.height = Math.max(150, Math.min(360, 24 + MARGIN.top + MARGIN.bottom + rows * 16)) + "px";
    var p = plot(svg, dom, [0, 1], null);
    var band = (p.bottom - p.top) / Math.max(1, rows);
    var bar = Math.max(2, Math.min(12, band * 0.7));
    var rowOf = {};
    var end = Math.max(page.now_s, dom[1]);
    nodes.forEach(function (n, i) {
      var yMid = p.top + band * (i + 0.5);
      rowOf[n.instance_id] = yMid;
      var x0 = p.x(n.launched_at), x1 = p.x(n.ended_at === null ? Math.min(end, dom[1]) : n.ended_at);
      var rect = svgEl("rect", {
        x: x0, y: yMid - bar / 2, width: Math.max(1.5, x1 - x0), height: bar, rx: 2,
        "class": "node " + n.tier + (n.ended_at === null ? " alive" : ""),
        "data-testid": "node-bar", "data-instance": n.instance_id, "data-tier": n.tier,
      });
      titled(rect, n.instance_id + " · " + n.instance_type + "@" + n.zone + " · " + n.tier +
        " · " + stamp(n.launched_at) + " → " + (n.ended_at === null ? "running" :
          stamp(n.ended_at) + " (" + n.end_reason + ")"));
      svg.appendChild(rect);
    });
    if (nodes.length && band >= 11) {
      svg.appendChild(svgEl("text", { x: p.left - 6, y: p.top + 10, "class": "tick y" }, "reliable"));
      var firstTransient = nodes.findIndex(function (n) { return n.tier !== "reliable"; });
      if (firstTransient >= 0) {
        svg.appendChild(svgEl("text", { x: p.left - 6, y: p.top + band * firstTransient + 10,
          "class": "tick y" }, "transient"));
      }
    }
    page.marks.forEach(function (m) {
      var x = p.x(m.t);
      if (m.kind === "eviction") {
        var y = rowOf[m.instance_id] !== undefined ? rowOf[m.instance_id] : p.top + 6;
        var s = 6;
        var mark = svgEl("path", {
          d: "M" + (x - s) + "," + (y - s) + "L" + (x + s) + "," + (y + s) + "M" + (x + s) + "," +
            (y - s) + "L" + (x - s) + "," + (y + s),
          "class": "mark eviction", "data-testid": "eviction-mark", "data-instance": m.instance_id,
        });
        titled(mark, "evicted " + stamp(m.t) + ": " + m.instance_id + " (" + m.detail + ")");
        svg.appendChild(mark);
      } else if (m.kind === "notice") {
        var yn = rowOf[m.instance_id] !== undefined ? rowOf[m.instance_id] : p.top + 6;
        var notice = svgEl("path", {
          d: "M" + x + "," + (yn - 9) + "l5,8h-10z", "class": "mark notice", "data-testid": "notice-mark",
        });
        titled(notice, m.detail + " notice " + stamp(m.t) + " for " + m.instance_id);
        svg.appendChild(notice);
      } else if (m.kind === "launch_failed") {
        var yf = p.top + band * (rows - 0.5);
        var failure = svgEl("circle", { cx: x, cy: yf, r: 4, "class": "mark failure", "data-testid": "failure-mark" });
        titled(failure, "launch refused " + stamp(m.t) + ": " + m.detail);
        svg.appendChild(failure);
      }
    });
    if (!nodes.length) emptyNote(p, "no instances yet");
    legend("legend-nodes", [
      { label: "reliable (on-demand)", color: "#0f766e" }, { label: "transient (spot)", color: "#60a5fa" },
      { label: "✕ eviction", color: "#dc2626" }, { label: "▲ notice", color: "#f59e0b" },
      { label: "● launch refused", color: "#6b7280" },
    ]);
  }

  function renderTraining(page, dom) {
    var svg = document.querySelector('[data-testid="chart-training"]');
    var reports = page.training;
    var losses = reports.map(function (r) { return r.loss; });
    var lossMax = maxOf(losses, 0) * 1.1 || 1;
    var lossMin = -maxOf(losses.map(function (v) { return v === null ? null : -v; }), 0) * 1.1;
    var p = plot(svg, dom, [lossMin, lossMax], function (v) { return num(v); });
    var itMax = maxOf(reports.map(function (r) { return r.iteration; }), 0) || 1;
    var scale = (lossMax - lossMin) / (itMax * 1.05);  // iterations on the right axis
    function itY(it) { return lossMin + it * scale; }
    series(p, "iterations", reports.map(function (r) { return [r.t, itY(r.iteration)]; }));
    series(p, "loss", reports.map(function (r) { return [r.t, r.loss]; }));
    var held = evaluationPoints(reports);
    if (held.points.length) {  // the held-out metric, its range scaled onto the loss axis
      var values = held.points.map(function (e) { return e.value; });
      var low = Math.min.apply(null, values), high = Math.max.apply(null, values);
      var span = high - low || Math.abs(high) || 1;
      low -= span * 0.05;
      span *= 1.1;
      var heldY = function (v) { return lossMin + (lossMax - lossMin) * (v - low) / span; };
      series(p, "evaluation", held.points.map(function (e) { return [e.t, heldY(e.value)]; }));
      held.points.forEach(function (e) {
        var dot = svgEl("circle", { cx: p.x(e.t), cy: p.y(heldY(e.value)), r: 3, "class": "evaluation" });
        titled(dot, held.metric + " " + num(e.value) + " after iteration " + num(e.iteration));
        svg.appendChild(dot);
      });
    }
    reports.forEach(function (r, i) {
      if (i > 0 && r.stage_transitions > reports[i - 1].stage_transitions) {
        var line = svgEl("line", { x1: p.x(r.t), x2: p.x(r.t), y1: p.top, y2: p.bottom, "class": "transition" });
        titled(line, "AgileML stage transition by " + stamp(r.t));
        svg.appendChild(line);
      }
    });
    var step = niceStep(itMax, 4);
    for (var it = 0; it <= itMax * 1.05; it += step) {
      svg.appendChild(svgEl("text", { x: p.right + 6, y: p.y(itY(it)) + 4, "class": "tick right" }, num(it)));
    }
    if (!reports.length) emptyNote(p, "no training reports" + (embedded ? " in this report" : " yet"));
    var last = reports.length ? reports[reports.length - 1] : null;
    legend("legend-training", [
      { label: "loss (left)", color: "#db2777" }, { label: "iterations (right)", color: "#64748b", dashed: true },
      { label: "stage transition" + (last ? " (" + last.stage_transitions + ")" : ""), color: "#a3a3a3" },
      { label: "FlexRR reassigned rows: " + (last ? num(last.reassigned) : "—"), color: "transparent" },
    ].concat(held.points.length ? [{
      label: "held-out " + held.metric + " (scaled): " + num(held.points[held.points.length - 1].value) +
        " after iteration " + num(held.points[held.points.length - 1].iteration),
      color: "#2563eb",
    }] : []));
  }

  // each evaluation once (the reports repeat the newest), of its first metric by name
  function evaluationPoints(reports) {
    var metric = null, seen = {}, points = [];
    reports.forEach(function (r) {
      var e = r.evaluation;
      if (!e || !e.metrics || seen[e.iteration]) return;
      if (metric === null) metric = Object.keys(e.metrics).sort()[0] || null;
      var has = metric !== null && Object.prototype.hasOwnProperty.call(e.metrics, metric);
      if (!has || typeof e.metrics[metric] !== "number") return;
      seen[e.iteration] = true;
      points.push({ t: r.t, iteration: e.iteration, value: e.metrics[metric] });
    });
    return { metric: metric, points: points };
  }

  function renderFleet(fleet, current) {
    var body = $("fleet-rows");
    clear(body);
    fleet.jobs.forEach(function (j) {
      var tr = el("tr", { "data-job": j.job_id, "class": j.job_id === current ? "current" : "" });
      var name = el("td");
      name.appendChild(el("strong", null, j.job_id));
      if (j.name && j.name !== j.job_id) name.appendChild(el("span", { "class": "hint" }, " " + j.name));
      tr.appendChild(name);
      tr.appendChild(el("td", null, null)).appendChild(el("span", { "class": "state " + j.state }, j.state));
      var spend = el("td", { "class": "num" }, usd(j.spent_usd) + " / " + usd(j.budget_usd));
      var meter = el("span", { "class": "meter" });
      meter.appendChild(el("i", { style: "width:" + Math.min(100, j.budget_usd > 0 ? 100 * j.spent_usd / j.budget_usd : 0) + "%" }));
      spend.appendChild(meter);
      tr.appendChild(spend);
      tr.appendChild(el("td", { "class": "num" }, usd(j.projected_cost_usd)));
      tr.appendChild(el("td", { "class": "num" }, usd(j.cost_per_work_usd)));
      tr.appendChild(el("td", { "class": "num" }, j.nodes_alive.reliable + " / " + j.nodes_alive.transient));
      tr.appendChild(el("td", { "class": "num" }, String(j.evictions)));
      tr.appendChild(el("td", { "class": "num" }, num(j.iterations)));
      tr.appendChild(el("td", { "class": "num" }, j.loss === null ? "—" : num(j.loss)));
      tr.addEventListener("click", function () { select(j.job_id); });
      body.appendChild(tr);
    });
    if (!fleet.jobs.length) {
      var empty = el("tr");
      empty.appendChild(el("td", { colspan: 9, "class": "hint" }, "no jobs yet: submit one with `orchestrator submit`"));
      body.appendChild(empty);
    }
  }

  function renderPipeline(page) {
    var stages = page.pipeline || [];
    $("pipeline-panel").hidden = !stages.length;  // data-parallel jobs have no stages
    var body = $("pipeline-rows");
    clear(body);
    stages.forEach(function (st) {
      var tr = el("tr", { "data-stage": String(st.stage) });
      tr.appendChild(el("td", { "class": "num" }, String(st.stage)));
      tr.appendChild(el("td", null, st.first_layer === st.last_layer ? String(st.first_layer)
        : st.first_layer + "–" + st.last_layer));
      tr.appendChild(el("td", null, st.nodes.join(", ")));
      body.appendChild(tr);
    });
  }

  function renderRates(page) {
    var rates = page.work_rates || [];
    $("rates-panel").hidden = !rates.length;  // nothing measured yet
    var body = $("rates-rows");
    clear(body);
    rates.forEach(function (r) {
      var tr = el("tr", { "data-gpu": r.gpu_model });
      tr.appendChild(el("td", null, r.gpu_model));
      tr.appendChild(el("td", { "class": "num" }, r.prior.toFixed(3)));
      tr.appendChild(el("td", { "class": "num" }, r.learned.toFixed(3)));
      tr.appendChild(el("td", { "class": "num" }, r.low.toFixed(3) + "–" + r.high.toFixed(3)));
      tr.appendChild(el("td", { "class": "num" }, r.observed_hours.toFixed(1)));
      body.appendChild(tr);
    });
  }

  function renderEvents(page) {
    var body = $("event-rows");
    clear(body);
    page.events.forEach(function (e) {
      var tr = el("tr", { "class": "kind-" + e.kind });
      tr.appendChild(el("td", { "class": "time" }, stamp(e.t)));
      tr.appendChild(el("td", null, e.kind.replace("_", " ")));
      tr.appendChild(el("td", null, e.text));
      body.appendChild(tr);
    });
  }

  function renderJob(page) {
    var job = page.job;
    $("job-id").textContent = job.job_id;
    var badge = $("job-state");
    badge.textContent = job.state;
    badge.className = "state " + job.state;
    renderCards(job);
    var dom = timeDomain(page);
    renderSpend(page, dom);
    renderCostPerWork(page, dom);
    renderPrices(page, dom);
    renderNodes(page, dom);
    renderTraining(page, dom);
    renderPipeline(page);
    renderRates(page);
    renderEvents(page);
  }

  function render() {
    var fleet = state.fleet, page = state.page;
    renderFleet(fleet, state.job);
    if (page) renderJob(page);
    document.body.dataset.job = page ? page.job.job_id : "";
    document.body.dataset.renderedAt = String(page ? page.now_s : fleet.now_s);
    document.body.dataset.state = "ready";
    $("banner").hidden = true;
    $("status").textContent = (embedded ? "report · data as of " : "live · controller clock ") +
      stamp(page ? page.now_s : fleet.now_s) + " UTC";
  }

  function fail(message) {
    document.body.dataset.state = "error";
    var banner = $("banner");
    banner.textContent = message;
    banner.hidden = false;
  }

  // ---- choosing the job

  function defaultJob(fleet) {
    var running = fleet.jobs.filter(function (j) { return j.state === "running"; });
    if (running.length) return running[0].job_id;
    var latest = null;
    fleet.jobs.forEach(function (j) { if (!latest || j.updated_at > latest.updated_at) latest = j; });
    return latest ? latest.job_id : null;
  }

  function hashJob() {
    var m = /(?:^#|&)job=([^&]+)/.exec(window.location.hash);
    if (!m) return null;
    try {
      return decodeURIComponent(m[1]);
    } catch (err) {
      return null;  // a malformed hash: show the default job
    }
  }

  function chooseJob(fleet) {
    var ids = fleet.jobs.map(function (j) { return j.job_id; });
    var wanted = hashJob();
    if (wanted && ids.indexOf(wanted) >= 0) return wanted;
    if (state.job && ids.indexOf(state.job) >= 0) return state.job;
    return defaultJob(fleet);
  }

  function select(jobId) {
    if (window.location.hash !== "#job=" + encodeURIComponent(jobId)) {
      window.location.hash = "job=" + encodeURIComponent(jobId);  // hashchange re-renders
    }
  }

  // ---- data sources

  function showEmbedded() {
    var pages = embedded.jobs || {};
    if (embedded.job) pages[embedded.job.job.job_id] = pages[embedded.job.job.job_id] || embedded.job;
    state.fleet = embedded.fleet;
    var wanted = hashJob();
    state.job = wanted && pages[wanted] ? wanted : (embedded.job ? embedded.job.job.job_id : null);
    state.page = state.job ? pages[state.job] : null;
    render();
  }

  function getJson(url) {
    return fetch(url, { cache: "no-store" }).then(function (r) {
      if (r.status === 401 || r.status === 403) {
        throw new Error("this dashboard needs a token: open it once as " +
          "/dashboard?token=<token>, with the API token or the read-only one " +
          "(ORCHESTRATOR_API__READ_TOKEN)");
      }
      if (!r.ok) {
        return r.text().then(function (t) { throw new Error(url + ": HTTP " + r.status + " " + t.slice(0, 200)); });
      }
      return r.json();
    });
  }

  function poll() {
    clearTimeout(state.timer);
    var asked = ++state.asked;  // a newer poll (e.g. after a job switch) wins over this one
    getJson("v1/dashboard").then(function (fleet) {
      var jobId = chooseJob(fleet);
      if (!jobId) return [fleet, null];
      return getJson("v1/jobs/" + encodeURIComponent(jobId) + "/dashboard").then(function (page) {
        return [fleet, page];
      });
    }).then(function (both) {
      if (asked !== state.asked) return;
      state.fleet = both[0];
      state.page = both[1];
      state.job = both[1] ? both[1].job.job_id : null;
      render();
    }).catch(function (err) {
      if (asked === state.asked) {
        fail("Cannot reach the controller (" + err.message + "); retrying every second.");
      }
    }).then(function () {
      if (asked === state.asked) state.timer = setTimeout(poll, POLL_MS);
    });
  }

  function start() {
    var node = document.getElementById("dashboard-data");
    if (node) {
      try {
        embedded = JSON.parse(node.textContent);
        showEmbedded();
      } catch (err) {
        fail("This report's data cannot be shown: " + err.message);
      }
      window.addEventListener("hashchange", showEmbedded);
    } else {
      window.addEventListener("hashchange", poll);
      poll();
    }
    var resizing = null;
    window.addEventListener("resize", function () {
      clearTimeout(resizing);
      resizing = setTimeout(function () { if (state.page) renderJob(state.page); }, 150);
    });
  }

  start();
})();
