"use strict";
// The live page: polls /ui/state, keeps what it has seen for a few minutes, and draws one card per
// device, per model and per model with versions, with small canvas charts. No framework, nothing
// fetched from elsewhere.
(() => {
  const params = new URLSearchParams(location.search);
  const POLL_MS = clamp(Number(params.get("poll_ms")) || 1000, 250, 60000);
  const HISTORY_S = 300;
  const WINDOW_S = clamp(Number(params.get("window_s")) || 10, 2, HISTORY_S);
  const STATE_URL = "/ui/state";
  const KEY_ITEM = "model-router-api-key";  // sessionStorage: gone when the tab closes
  // The `outcome` counters of a model, grouped by the HTTP status they answer with.
  const CLASSES = [
    ["200", ["ok"]], ["4xx", ["bad_input"]], ["503", ["rejected_full", "unavailable", "rejected_shutdown", "out_of_memory"]],
    ["504", ["deadline", "execution_timeout"]], ["500", ["error"]], ["499", ["cancelled"]],
  ];
  const CLASS_OF = {};
  for (const [status, outcomes] of CLASSES) for (const o of outcomes) CLASS_OF[o] = status;
  const COLUMNS = [...CLASSES.map(([status]) => status), "other"];  // "other": outcomes this page does not know
  const RESIDENCY = ["residency", "loads", "evictions", "cold_starts", "last_used", "pinned"];
  const STATE_BADGE = {ready: "ok", degraded: "warn", failed: "bad", loading: "info", pending: "info", stopped: ""};
  const ERRORS = ["500", "503", "504"];  // the statuses a version's error share counts (the server's, not the caller's)
  const VERSION_COLUMNS = [
    ["weight", "share of the name's requests routed to it"], ["answers / s", `its answers over the last ${WINDOW_S} s`],
    ["errors", "share of its answers that were 500, 503 or 504"],
    ["agreement", "mean agreement of its answers with the stable version's on the same inputs (shadow copies)"],
    ["shadow served", "shadow copies it answered (total)"], ["shadow shed", "shadow copies refused for want of spare capacity (total)"],
  ];

  const history = [];  // snapshots from /ui/state, oldest first
  let timer = null;
  let inflight = false;
  const $ = (id) => document.getElementById(id);
  // Theme colours, read once (reading computed style after DOM changes costs a style pass each time).
  const colours = new Map();
  const css = (name) => {
    if (!colours.has(name)) colours.set(name, getComputedStyle(document.documentElement).getPropertyValue(name).trim());
    return colours.get(name);
  };
  matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => { colours.clear(); if (history.length) render(); });

  function clamp(value, low, high) { return Math.min(high, Math.max(low, value)); }

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs)) {
      if (key === "class") node.className = value; else node.setAttribute(key, value);
    }
    for (const child of children) node.append(child);
    return node;
  }

  // -- formatting ----------------------------------------------------------------------------

  function fmtBytes(bytes) {
    if (bytes === null || bytes === undefined) return "–";
    const units = [["GiB", 2 ** 30, 2], ["MiB", 2 ** 20, 1], ["KiB", 2 ** 10, 0]];
    for (const [unit, size, digits] of units) if (Math.abs(bytes) >= size) return `${(bytes / size).toFixed(digits)} ${unit}`;
    return `${bytes} B`;
  }
  function fmtSeconds(s) {
    if (s === null || s === undefined || !Number.isFinite(s)) return "–";
    if (s >= 1) return `${s.toFixed(2)} s`;
    const ms = s * 1000;
    return `${ms < 10 ? ms.toFixed(2) : ms.toFixed(ms < 100 ? 1 : 0)} ms`;
  }
  function fmtRate(r) { return r === null ? "–" : r < 10 ? r.toFixed(1) : r.toFixed(0); }
  function fmtShare(x) { return x === null ? "–" : `${(100 * x).toFixed(x > 0.999 && x < 1 ? 2 : 1)}%`; }
  function fmtAny(value, now) {
    if (typeof value === "number" && value > 1e9) return `${Math.max(0, now - value).toFixed(0)} s ago`;  // unix time
    return typeof value === "object" ? JSON.stringify(value) : String(value);
  }

  // -- maths over snapshots --------------------------------------------------------------------

  // The snapshot about `seconds` before the newest (or the oldest one kept).
  function before(seconds) {
    const newest = history[history.length - 1];
    for (let i = history.length - 2; i >= 0; i--) if (history[i].time <= newest.time - seconds) return history[i];
    return history[0];
  }
  function statusCounts(model) {
    const counts = Object.fromEntries(COLUMNS.map((c) => [c, 0]));
    for (const [outcome, n] of Object.entries((model && model.requests) || {})) counts[CLASS_OF[outcome] || "other"] += n;
    return counts;
  }
  // Counts since `old`; a counter that went down means the router restarted: count from zero.
  function delta(now, old) { return old === undefined || old > now ? now : now - old; }
  function bucketDelta(now, old) {
    if (!now) return null;
    if (!old || old.count > now.count) return now.counts;
    return now.counts.map((n, i) => n - old.counts[i]);
  }
  // Linear interpolation inside the bucket, as Prometheus' histogram_quantile.
  function quantile(q, bounds, counts) {
    if (!counts || !counts[counts.length - 1]) return null;
    const rank = q * counts[counts.length - 1];
    for (let i = 0; i < counts.length; i++) {
      if (counts[i] < rank) continue;
      if (i >= bounds.length) return bounds[bounds.length - 1];
      const lower = i ? bounds[i - 1] : 0;
      const below = i ? counts[i - 1] : 0;
      const inside = counts[i] - below;
      return lower + (bounds[i] - lower) * (inside ? (rank - below) / inside : 1);
    }
    return null;
  }

  // -- polling -----------------------------------------------------------------------------------

  function schedule(ms = POLL_MS) {
    if (timer === null && !inflight) timer = setTimeout(poll, ms);
  }
  function authHeaders() {
    const key = sessionStorage.getItem(KEY_ITEM);
    return key ? {Authorization: `Bearer ${key}`} : {};
  }
  async function poll() {
    timer = null;
    if (document.hidden) return;  // a hidden tab costs the router nothing; it resumes when shown
    inflight = true;
    const started = performance.now();
    try {
      const response = await fetch(STATE_URL, {headers: authHeaders(), cache: "no-store"});
      if (response.status === 401 || response.status === 403) return askForKey(response.status);
      if (!response.ok) throw new Error(`HTTP ${response.status} from ${STATE_URL}`);
      const state = await response.json();
      state.fetch_ms = performance.now() - started;
      remember(state);
      render();
      message(null);
    } catch (error) {
      status("unreachable", "bad");
      message(`${error.message || error}; retrying`);
    } finally {
      inflight = false;
      if ($("key-form").hidden) schedule();
    }
  }
  function remember(state) {
    state.byName = Object.fromEntries(state.models.map((m) => [m.name, m]));
    state.pipelines = state.pipelines || [];
    state.pipelineByName = Object.fromEntries(state.pipelines.map((p) => [p.name, p]));
    state.routes = state.routes || [];
    state.routeByName = Object.fromEntries(state.routes.map((r) => [r.name, r]));
    const newest = history[history.length - 1];
    if (newest && state.time < newest.time) history.length = 0;  // the clock went back: start again
    history.push(state);
    while (history.length > 2 && history[0].time < state.time - HISTORY_S) history.shift();
  }
  function askForKey(code) {
    $("key-form").hidden = false;
    $("forget").hidden = !sessionStorage.getItem(KEY_ITEM);
    status(code === 403 ? "key refused" : "key needed", "warn");
    message("This router requires an API key: paste an inference (or admin) key. It is kept in this tab's " +
            "sessionStorage only and sent as a bearer header to /ui/state.");
    $("key").focus();
  }
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_ITEM, key);
    $("key").value = "";
    $("key-form").hidden = true;
    $("forget").hidden = false;
    schedule(0);
  });
  $("forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_ITEM);
    $("forget").hidden = true;
    schedule(0);
  });
  document.addEventListener("visibilitychange", () => { if (!document.hidden) schedule(0); });
  window.addEventListener("resize", () => { if (history.length) render(); });

  // -- rendering -------------------------------------------------------------------------------

  function status(text, kind) {
    $("status").textContent = text;
    $("status").className = `badge ${kind}`;
  }
  function message(text) {
    $("message").hidden = !text;
    $("message").textContent = text || "";
  }
  function set(card, field, text, value) {
    const node = card.querySelector(`[data-field="${field}"]`);
    if (!node) return;
    if (node.textContent !== text) node.textContent = text;
    if (value !== undefined) node.dataset.value = String(value);
  }
  function stat(label, field, title = "") {
    return el("div", {title}, el("dt", {}, label), el("dd", {"data-field": field}, "–"));
  }
  function cardFor(container, kind, name, build) {
    let card = container.querySelector(`[data-${kind}="${CSS.escape(name)}"]`);
    if (!card) {
      card = build(name);
      container.append(card);
    }
    return card;
  }
  function prune(container, kind, names) {
    for (const card of [...container.children]) if (!names.has(card.dataset[kind])) card.remove();
  }

  function render() {
    const state = history[history.length - 1];
    status(state.draining ? "draining" : state.ready ? "ready" : "not ready", state.draining || !state.ready ? "warn" : "ok");
    $("updated").textContent = `v${state.version} · updated ${new Date(state.time * 1000).toLocaleTimeString()} · ` +
      `/ui/state in ${state.fetch_ms.toFixed(0)} ms · every ${POLL_MS / 1000} s`;
    $("history").textContent = `${HISTORY_S / 60} minutes`;
    $("window").textContent = `${WINDOW_S} s`;
    const devices = $("devices");
    for (const device of state.devices) renderDevice(cardFor(devices, "device", device.name, deviceCard), device, state);
    for (const [name, error] of Object.entries(state.device_errors)) {
      const card = cardFor(devices, "device", name, deviceCard);
      set(card, "admission", "unavailable");
      card.querySelector("[data-field=admission]").className = "badge bad";
      set(card, "error", error);
      card.querySelector("[data-field=error]").hidden = false;
    }
    prune(devices, "device", new Set([...state.devices.map((d) => d.name), ...Object.keys(state.device_errors)]));
    const models = $("models");
    for (const model of state.models) renderModel(cardFor(models, "model", model.name, modelCard), model, state);
    prune(models, "model", new Set(state.models.map((m) => m.name)));
    versionsSection().hidden = !state.routes.length;
    const routes = $("versions");
    for (const r of state.routes) renderRoute(cardFor(routes, "route", r.name, routeCard), r, state);
    prune(routes, "route", new Set(state.routes.map((r) => r.name)));
    const pipelines = $("pipelines");
    $("pipelines-section").hidden = !state.pipelines.length;
    for (const p of state.pipelines) renderPipeline(cardFor(pipelines, "pipeline", p.name, pipelineCard), p, state);
    prune(pipelines, "pipeline", new Set(state.pipelines.map((p) => p.name)));
  }

  // -- versions: one card per model with versions; a row per version, rates over the window ------

  function versionsSection() {
    let section = $("versions-section");
    if (!section) {
      section = el("section", {id: "versions-section", hidden: ""}, el("h2", {}, "Versions"),
        el("div", {id: "versions", class: "grid"}));
      $("pipelines-section").before(section);
    }
    return section;
  }

  function routeCard(name) {
    return el("article", {class: "card route", "data-route": name},
      el("h3", {}, name, el("span", {class: "badge", "data-field": "rollout"}, "–"),
        el("span", {class: "muted", "data-field": "where"})),
      el("p", {class: "muted", "data-field": "reason", hidden: ""}),
      el("table", {class: "outcomes"},
        el("thead", {}, el("tr", {}, el("th", {}, "version"), ...VERSION_COLUMNS.map(([c, title]) => el("th", {title}, c)))),
        el("tbody")));
  }

  function renderRoute(card, r, state) {
    const mirror = r.mirror ? ` · mirror ${r.mirror.version} at ${+r.mirror.percent.toFixed(2)}%` : "";
    set(card, "where", `stable ${r.stable}${mirror} · generation ${r.generation}`);
    const [label, kind, reason] = rolloutStatus(r.rollout);
    set(card, "rollout", label);
    card.querySelector("[data-field=rollout]").className = `badge ${kind}`;
    const why = card.querySelector("[data-field=reason]");
    why.hidden = !reason;
    set(card, "reason", reason);
    const body = card.querySelector("tbody");
    const keys = r.versions.map((v) => v.version).join();
    if (body.dataset.keys !== keys) {
      body.replaceChildren(...r.versions.map((v) => el("tr", {},
        el("td", {"data-field": `version-${v.version}`}, v.version),
        ...VERSION_COLUMNS.map(([c]) => el("td", {"data-field": `${c.replace(/[^a-z]+/g, "-")}-${v.version}`}, "–")))));
      body.dataset.keys = keys;
    }
    const old = before(WINDOW_S);
    const seconds = state.time - old.time;
    const was = ((old.routeByName || {})[r.name] || {versions: []}).versions;
    for (const v of r.versions) {
      const o = was.find((x) => x.version === v.version);
      const marks = [v.stable && "stable", v.mirror && "mirror", r.rollout && r.rollout.candidate === v.version && "candidate"];
      set(card, `version-${v.version}`, [v.version, ...marks.filter(Boolean)].join(" · "));
      set(card, `weight-${v.version}`, `${+v.weight.toFixed(2)}%`, v.weight);
      const now = statusCounts(v), then = statusCounts(o);
      const answers = COLUMNS.reduce((sum, c) => sum + delta(now[c], then[c]), 0);
      const errors = ERRORS.reduce((sum, c) => sum + delta(now[c], then[c]), 0);
      set(card, `answers-s-${v.version}`, seconds > 0 ? fmtRate(answers / seconds) : "–");
      set(card, `errors-${v.version}`, answers ? fmtShare(errors / answers) : "–", answers ? errors / answers : "");
      const mean = agreementSince(v.agreement[r.stable], o && o.agreement[r.stable]);
      set(card, `agreement-${v.version}`, mean === null ? "–" : mean.toFixed(3), mean ?? "");
      for (const outcome of ["served", "shed"]) {
        const n = v.shadow[outcome] || 0;
        set(card, `shadow-${outcome}-${v.version}`, String(n), n);
      }
    }
  }

  // The mean agreement of the comparisons made since `old` (all of them after a restart); null if none.
  function agreementSince(now, old) {
    if (!now) return null;
    const fresh = !old || old.count > now.count;
    const count = fresh ? now.count : now.count - old.count;
    return count ? (now.sum - (fresh ? 0 : old.sum)) / count : null;
  }

  // A rollout as [badge text, badge kind, the line under the title].
  function rolloutStatus(rollout) {
    if (!rollout) return ["no rollout", "", ""];
    const steps = rollout.steps || [];
    if (rollout.status === "running" && !rollout.reason) {  // an operator's stop leaves it "running", with a reason
      return [`rollout: step ${rollout.step + 1} of ${steps.length}`, "info",
        `version ${rollout.candidate} at ${steps[rollout.step]}%: ${rollout.step_answers} answers this step ` +
        `(${rollout.step_failures} failed) in ${Math.round(rollout.step_elapsed_s)} s`];
    }
    if (rollout.status === "promoted") return ["promoted", "ok", `version ${rollout.candidate}: ${rollout.reason || ""}`];
    if (rollout.status === "rolled_back") return ["rolled back", "bad", `version ${rollout.candidate}: ${rollout.reason || ""}`];
    return ["rollout stopped", "warn", `version ${rollout.candidate} at step ${rollout.step + 1} of ${steps.length}: ` +
      `${rollout.reason || ""}`];
  }

  // -- pipelines: one card each; per step, items per request and mean batch size over the window --

  function pipelineCard(name) {
    return el("article", {class: "card model", "data-pipeline": name},
      el("h3", {}, name, el("span", {class: "badge", "data-field": "state"}, "–"),
        el("span", {class: "muted", "data-field": "chain"})),
      el("p", {class: "error", "data-field": "error", hidden: ""}),
      outcomesTable(),
      el("dl", {class: "stats"}, stat("latency p50 (200s)", "p50"), stat("latency p99 (200s)", "p99")),
      el("dl", {class: "stats", "data-field": "steps"}));
  }

  function renderPipeline(card, p, state) {
    set(card, "state", p.state);
    card.querySelector("[data-field=state]").className = `badge ${STATE_BADGE[p.state] ?? "bad"}`;
    set(card, "chain", p.chain);
    const error = card.querySelector("[data-field=error]");
    error.hidden = !p.error;
    set(card, "error", p.error || "");
    const old = before(WINDOW_S);
    const seconds = state.time - old.time;
    const was = (old.pipelineByName || {})[p.name];
    renderOutcomes(card, statusCounts(p), statusCounts(was), seconds);
    const latency = bucketDelta(p.histograms.latency, was && was.histograms.latency);
    set(card, "p50", fmtSeconds(quantile(0.5, state.buckets.latency, latency)));
    set(card, "p99", fmtSeconds(quantile(0.99, state.buckets.latency, latency)));
    const steps = card.querySelector("[data-field=steps]");
    const keys = p.steps.map((s) => s.step).join();
    if (steps.dataset.keys !== keys) {
      steps.replaceChildren(...p.steps.flatMap((s) => [stat(`${s.step} items / request`, `items-${s.step}`),
        stat(`${s.step} mean batch`, `batch-${s.step}`, "the size of the batch each of the step's items ran in")]));
      steps.dataset.keys = keys;
    }
    const mean = (nowSum, oldSum) => {
      if (!nowSum) return null;
      const count = delta(nowSum.count, oldSum && oldSum.count), sum = nowSum.sum - ((oldSum && oldSum.count <= nowSum.count) ? oldSum.sum : 0);
      return count ? sum / count : null;
    };
    for (const s of p.steps) {
      const o = was && was.steps.find((x) => x.step === s.step);
      const items = mean(s.items, o && o.items), batch = mean(s.batch_sizes, o && o.batch_sizes);
      set(steps, `items-${s.step}`, items === null ? "–" : items.toFixed(1), items);
      set(steps, `batch-${s.step}`, batch === null ? "–" : batch.toFixed(2), batch);
    }
  }

  function legend(items) {
    return el("div", {class: "legend"}, ...items.map(([label, color]) => {
      const swatch = el("i");
      swatch.style.background = css(color);
      return el("span", {}, swatch, label);
    }));
  }

  function deviceCard(name) {
    return el("article", {class: "card device", "data-device": name},
      el("h3", {}, name, el("span", {class: "badge", "data-field": "admission"}, "–")),
      el("p", {class: "error", "data-field": "error", hidden: ""}),
      el("dl", {class: "stats"},
        stat("budget", "budget"), stat("probe reading", "used", "the live reading: NVML on a GPU, host RAM on the CPU"),
        stat("of total", "total"), stat("ledger: weights", "weights"),
        stat("ledger: reservations", "reserved", "bytes reserved by running batches"),
        stat("ledger peak", "peak"), stat("high watermark", "high", "admission pauses above this"),
        stat("low watermark", "low", "admission resumes below this"), stat("running batches", "running"),
        stat("probe errors", "probe-errors"), stat("scheduler restarts", "restarts")),
      el("canvas"),
      legend([["probe reading", "--c-used"], ["ledger (weights + reservations)", "--c-ledger"],
              ["budget", "--c-budget"], ["high watermark", "--c-high"], ["low watermark", "--c-low"]]));
  }

  function renderDevice(card, d, state) {
    const badge = card.querySelector("[data-field=admission]");
    set(card, "admission", d.paused ? "admission paused" : "admitting", d.paused);
    badge.className = `badge ${d.paused ? "bad" : "ok"}`;
    set(card, "budget", fmtBytes(d.budget_bytes), d.budget_bytes);
    set(card, "used", fmtBytes(d.used_bytes), d.used_bytes);
    set(card, "total", fmtBytes(d.total_bytes), d.total_bytes);
    set(card, "weights", fmtBytes(d.weights_bytes), d.weights_bytes);
    set(card, "reserved", fmtBytes(d.reserved_bytes), d.reserved_bytes);
    set(card, "peak", fmtBytes(d.peak_bytes), d.peak_bytes);
    const mark = (share) => `${+(100 * share).toFixed(1)}% = ${fmtBytes(share * d.budget_bytes)}`;
    set(card, "high", mark(d.high_watermark), d.high_watermark);
    set(card, "low", mark(d.low_watermark), d.low_watermark);
    set(card, "running", String(d.running_batches), d.running_batches);
    set(card, "probe-errors", String(d.probe_errors), d.probe_errors);
    set(card, "restarts", String(d.restarts), d.restarts);
    const points = (f) => history.map((s) => {
      const x = s.devices.find((e) => e.name === d.name);
      return [s.time, x ? f(x) : null];
    });
    const series = [
      {color: "--c-budget", points: points((x) => x.budget_bytes)},
      {color: "--c-high", dash: [4, 3], points: points((x) => x.high_watermark * x.budget_bytes)},
      {color: "--c-low", dash: [2, 3], points: points((x) => x.low_watermark * x.budget_bytes)},
      {color: "--c-used", width: 2, points: points((x) => x.used_bytes)},
      {color: "--c-ledger", width: 2, points: points((x) => x.weights_bytes + x.reserved_bytes)},
    ];
    drawChart(card.querySelector("canvas"), series, state.time, fmtBytes);
  }

  // The outcome counters by status: a row of rates over the window, a row of totals.
  function outcomesTable() {
    const head = el("tr", {}, el("th"), ...COLUMNS.map((c) => el("th", {}, c)));
    const row = (label, prefix) => el("tr", {}, el("td", {}, label),
      ...COLUMNS.map((c) => el("td", {"data-field": `${prefix}-${c}`}, "–")));
    return el("table", {class: "outcomes"}, el("thead", {}, head),
      el("tbody", {}, row(`per s (${WINDOW_S} s)`, "rate"), row("total", "total")));
  }
  function renderOutcomes(card, now, then, seconds) {
    for (const c of COLUMNS) {
      set(card, `total-${c}`, String(now[c]), now[c]);
      set(card, `rate-${c}`, seconds > 0 ? fmtRate(delta(now[c], then[c]) / seconds) : "–");
    }
  }

  function modelCard(name) {
    return el("article", {class: "card model", "data-model": name},
      el("h3", {}, name, el("span", {class: "badge", "data-field": "state"}, "–"),
        el("span", {class: "muted", "data-field": "where"})),
      el("p", {class: "error", "data-field": "error", hidden: ""}),
      el("dl", {class: "stats", "data-field": "residency", hidden: ""}),
      el("div", {class: "queue"}, el("span", {class: "muted"}, "queue"), el("div", {class: "bar"}, el("span")),
        el("span", {}, el("span", {"data-field": "queue-depth"}, "–"), " / ", el("span", {"data-field": "queue-capacity"}, "–"))),
      outcomesTable(),
      el("dl", {class: "stats"},
        stat("latency p50 (200s)", "p50"), stat("latency p99 (200s)", "p99"),
        stat("within deadline", "slo", "share of requests answered 200 within their deadline"),
        stat("queue wait p50", "wait-p50"), stat("queue wait p99", "wait-p99"), stat("batches / s", "batch-rate")),
      el("canvas"),
      legend(COLUMNS.slice(0, 6).map((c) => [c, `--c-${c}`])),
      el("div", {class: "muted"}, "batch sizes, last ", el("span", {"data-field": "batch-span"}, "–")),
      el("div", {class: "batches"}));
  }

  function renderModel(card, m, state) {
    const badge = card.querySelector("[data-field=state]");
    set(card, "state", m.state);
    badge.className = `badge ${STATE_BADGE[m.state] ?? ""}`;
    const instances = m.instances.length;
    set(card, "where", `${[...new Set(m.devices)].join(", ")} · ${instances} instance${instances === 1 ? "" : "s"}` +
      `${m.required ? " · required" : ""}`);
    const error = card.querySelector("[data-field=error]");
    error.hidden = !m.error;
    set(card, "error", m.error || "");
    renderResidency(card.querySelector("[data-field=residency]"), m, state.time);
    const {depth, capacity} = m.queue;
    set(card, "queue-depth", String(depth), depth);
    set(card, "queue-capacity", String(capacity), capacity);
    const share = capacity ? depth / capacity : 0;
    const bar = card.querySelector(".bar");
    bar.className = `bar ${share >= 0.8 ? "bad" : share >= 0.5 ? "warn" : ""}`;
    bar.firstChild.style.width = `${(100 * share).toFixed(1)}%`;

    const old = before(WINDOW_S);
    const seconds = state.time - old.time;
    const was = old.byName[m.name];
    const now = statusCounts(m), then = statusCounts(was);
    renderOutcomes(card, now, then, seconds);
    const requests = COLUMNS.reduce((sum, c) => sum + delta(now[c], then[c]), 0);
    const good = delta(m.within_deadline, was && was.within_deadline);
    set(card, "slo", requests ? fmtShare(good / requests) : "–");
    const h = m.histograms, o = (was && was.histograms) || {};
    const latency = bucketDelta(h.latency, o.latency), wait = bucketDelta(h.queue_wait, o.queue_wait);
    set(card, "p50", fmtSeconds(quantile(0.5, state.buckets.latency, latency)));
    set(card, "p99", fmtSeconds(quantile(0.99, state.buckets.latency, latency)));
    set(card, "wait-p50", fmtSeconds(quantile(0.5, state.buckets.queue_wait, wait)));
    set(card, "wait-p99", fmtSeconds(quantile(0.99, state.buckets.queue_wait, wait)));
    const batches = h.batch_size ? delta(h.batch_size.count, o.batch_size && o.batch_size.count) : 0;
    set(card, "batch-rate", seconds > 0 ? fmtRate(batches / seconds) : "–");
    renderBatches(card, m, state);
    drawChart(card.querySelector("canvas"), rateSeries(m.name), state.time, fmtRate);
  }

  function renderResidency(node, m, now) {
    const present = RESIDENCY.filter((key) => key in m && m[key] !== null);
    node.hidden = !present.length;
    if (node.dataset.keys !== present.join()) {
      node.replaceChildren(...present.map((key) => stat(key.replace("_", " "), `residency-${key}`)));
      node.dataset.keys = present.join();
    }
    for (const key of present) set(node, `residency-${key}`, fmtAny(m[key], now));
  }

  // Requests per second by status over the history, each point over three polls.
  function rateSeries(name) {
    const series = Object.fromEntries(COLUMNS.slice(0, 6).map((c) => [c, []]));
    for (let i = 3; i < history.length; i++) {
      const a = history[i - 3], b = history[i];
      const then = statusCounts(a.byName[name]), now = statusCounts(b.byName[name]);
      for (const c of Object.keys(series)) series[c].push([b.time, delta(now[c], then[c]) / (b.time - a.time)]);
    }
    return Object.entries(series).map(([c, points]) => ({color: `--c-${c}`, width: c === "200" ? 2 : 1.5, points}));
  }

  function renderBatches(card, m, state) {
    const bounds = state.buckets.batch_size;
    const counts = bucketDelta(m.histograms.batch_size, history[0].byName[m.name]?.histograms.batch_size);
    set(card, "batch-span", `${Math.round(state.time - history[0].time)} s`);
    const last = Math.max(0, bounds.findIndex((b) => b >= m.batch.max_size));
    const bars = [];
    for (let i = 0; i <= last; i++) {
      const n = counts ? counts[i] - (i ? counts[i - 1] : 0) : 0;
      const low = i ? bounds[i - 1] + 1 : 1;
      bars.push([low === bounds[i] ? `${low}` : `${low}–${bounds[i]}`, n]);
    }
    const peak = Math.max(1, ...bars.map(([, n]) => n));
    const box = card.querySelector(".batches");
    if (box.children.length !== bars.length) {
      box.replaceChildren(...bars.map(() => el("div", {}, el("span"), el("small"))));
    }
    bars.forEach(([label, n], i) => {
      const column = box.children[i];
      column.title = `${n} batch${n === 1 ? "" : "es"} of ${label}`;
      column.firstChild.style.height = `${(100 * n / peak).toFixed(1)}%`;
      column.lastChild.textContent = label;
      column.dataset.value = String(n);
    });
  }

  // A line chart of what the page has seen (at least a minute, at most HISTORY_S); y from 0 to the largest value.
  function drawChart(canvas, series, now, format) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (!width || !height) return;
    if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
    if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const left = 62, right = 6, top = 6, bottom = 16;
    const span = clamp(now - history[0].time, 60, HISTORY_S);
    const start = now - span;
    let max = 0;
    for (const s of series) for (const [t, v] of s.points) if (t >= start && v !== null) max = Math.max(max, v);
    max = max > 0 ? max * 1.1 : 1;
    const x = (t) => left + ((t - start) / span) * (width - left - right);
    const y = (v) => top + (1 - v / max) * (height - top - bottom);
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = css("--muted");
    ctx.strokeStyle = css("--line");
    ctx.lineWidth = 1;
    ctx.setLineDash([]);
    for (const f of [0, 0.5, 1]) {
      const v = (max / 1.1) * f;
      ctx.beginPath();
      ctx.moveTo(left, y(v));
      ctx.lineTo(width - right, y(v));
      ctx.stroke();
      ctx.fillText(format(v), 2, y(v) + 3);
    }
    ctx.fillText(span >= 120 ? `−${Math.round(span / 60)} min` : `−${Math.round(span)} s`, left, height - 3);
    ctx.textAlign = "right";
    ctx.fillText("now", width - right, height - 3);
    ctx.textAlign = "left";
    for (const s of series) {
      ctx.strokeStyle = css(s.color);
      ctx.lineWidth = s.width || 1.5;
      ctx.setLineDash(s.dash || []);
      ctx.beginPath();
      let drawing = false;
      for (const [t, v] of s.points) {
        if (v === null || v === undefined || t < start) { drawing = false; continue; }
        if (drawing) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
        drawing = true;
      }
      ctx.stroke();
    }
  }

  schedule(0);
})();
