// kvwall explore: the form's state is a query string with the command line's option names; each change posts it
// to /api/explore (kvwall.api's results, to_dict()) and draws what comes back. Charts: plotly.min.js, served by
// kvwall itself. Formatting mirrors kvwall.units (fmt_bytes, fmt_tokens) and the commands' tables, so the page
// reads as the CLI prints.
"use strict";

let OPTS = [];  // the form's options besides the model: kvwall.explore.app.OPTIONS, from /api/options
const ALWAYS = ["device", "tp", "batch", "context"];
const $ = (id) => document.getElementById(id);
let seq = 0;
let timer = null;
let options = null;

// -- formatting (kvwall.units) ----------------------------------------------------------------------------------

function fixed(n, digits) {  // Python's f"{n:.{digits}f}": an exact tie rounds to even (toFixed rounds it up)
  // n is a tie (k + 1/2) / 10^d exactly when n x 2^(d+1) is an odd integer (a power of 2 multiplies exactly;
  // 1.05 x 10 rounds to 10.5, but the double 1.05 is above the tie)
  const twice = n * 2 ** (digits + 1);
  if (Number.isInteger(twice) && Math.abs(twice) % 2 === 1) {
    const f = Math.floor(n * 10 ** digits);
    return ((f % 2 === 0 ? f : f + 1) / 10 ** digits).toFixed(digits);
  }
  return n.toFixed(digits);
}

function fmtBytes(n, digits = 1) {  // kvwall.units.fmt_bytes: 131072 -> "128 KiB"
  n = Number(n);
  for (const unit of ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]) {
    if (Math.abs(n) < 1024 || unit === "PiB") {
      if (unit === "B") return `${Math.trunc(n)} B`;
      return `${fixed(n, digits).replace(/0+$/, "").replace(/\.$/, "")} ${unit}`;
    }
    n /= 1024;
  }
}

function fmtTokens(n) {  // kvwall.units.fmt_tokens: 131072 -> "128k"
  for (const [suffix, mult] of [["M", 1 << 20], ["k", 1 << 10]]) {
    if (n >= mult && n % mult === 0) return `${n / mult}${suffix}`;
  }
  return n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(2)}M` : String(n);
}

const comma = (n, digits = 0) => Number(n).toLocaleString("en-US",
  {minimumFractionDigits: digits, maximumFractionDigits: digits});
const fmtTime = (s) => (s < 1 ? `${comma(s * 1e3, 3)} ms` : `${comma(s, 2)} s`);  // speed's _ms
const gb = (b) => Number((b / 1e9).toPrecision(6)).toString();  // Python's f"{b / 1e9:g}"

function show(id, text, value) {
  const el = $(id);
  el.textContent = text;
  if (value === undefined || value === null) el.removeAttribute("data-value");
  else el.dataset.value = String(value);
}

// -- the form <-> the query ---------------------------------------------------------------------------------------

function readForm() {
  const q = new URLSearchParams();
  if (!$("config").value.trim()) {
    q.append("model", $("model").value);
    for (const o of $("compare").selectedOptions) if (o.value !== $("model").value) q.append("model", o.value);
  }
  for (const k of OPTS) {
    const v = $(k).value.trim();
    // the URL keeps what was chosen: a default is left out, except the ones the issue's URL always spells
    if (v && (ALWAYS.includes(k) || v !== options.defaults[k])) q.append(k, v);
  }
  return q;
}

function writeForm(q) {
  const models = q.getAll("model").flatMap((m) => m.split(",")).filter((m) => m);
  if (models.length) {
    if (![...$("model").options].some((o) => o.value === models[0])) $("model").add(new Option(models[0], models[0]));
    $("model").value = models[0];
  }
  for (const o of $("compare").options) o.selected = models.slice(1).includes(o.value);
  for (const k of OPTS) {
    if (q.has(k)) {
      if ($(k).tagName === "SELECT" && ![...$(k).options].some((o) => o.value === q.get(k))) $(k).add(new Option(q.get(k), q.get(k)));
      $(k).value = q.get(k);
    } else if (k in options.defaults) $(k).value = options.defaults[k];
    else $(k).value = "";
  }
}

function schedule() {
  clearTimeout(timer);
  timer = setTimeout(update, 250);
}

async function update() {
  const mine = ++seq;
  const q = readForm();
  const config = $("config").value.trim() || null;
  history.replaceState(null, "", `?${q.toString()}`);
  $("model").disabled = $("compare").disabled = Boolean(config);
  setState("loading", mine);
  let r, body;
  try {
    r = await fetch("/api/explore", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({query: q.toString(), config})});
    body = await r.json();
  } catch (e) {
    body = {error: `kvwall explore's server did not answer (${e}); is \`kvwall explore\` still running?`};
  }
  if (mine !== seq) return;  // a later change is on its way
  if (!r || !r.ok || body.error) {
    $("error").textContent = `kvwall: error: ${body.error}`;
    $("error").hidden = false;
    $("results").classList.add("stale");
    setState("error", mine);
    return;
  }
  $("error").hidden = true;
  $("results").classList.remove("stale");
  render(body);
  setState("ready", mine);
  $("status").dataset.query = q.toString();
}

function setState(state, n) {
  const s = $("status");
  s.dataset.state = state;
  s.dataset.seq = String(n);
  s.textContent = {loading: "updating...", ready: "up to date", error: "not updated: see the error"}[state];
}

// -- drawing ------------------------------------------------------------------------------------------------------

function render(r) {
  const first = r.models[0];
  const mem = first.memory;
  const fit = first.fit;
  const sp = r.speed.models[0];
  const par = mem.gpus > 1 ? `, ${r.roofline.parallel}` : "";
  $("title").textContent = `${mem.model}: batch ${mem.batch} x ${fmtTokens(mem.context)} tokens; weights ` +
    `${mem.formats.weights}, KV ${mem.formats.kv}, state ${mem.formats.state}${par}`;
  const b = mem.cache_bytes_per_token;
  show("bytes-per-token", `${fmtBytes(b)} (${comma(b)} B)`, b);
  show("fixed-state", fmtBytes(mem.fixed_bytes_per_sequence), mem.fixed_bytes_per_sequence);
  show("weights-gpu", fmtBytes(mem.per_gpu.weight_bytes), mem.per_gpu.weight_bytes);
  show("cache-gpu", fmtBytes(mem.per_gpu.cache_bytes), mem.per_gpu.cache_bytes);
  show("total-gpu", fmtBytes(mem.per_gpu.total_bytes), mem.per_gpu.total_bytes);
  show("max-context", ...longest(fit));
  show("ttft", `${fmtTime(sp.ttft_s)} (${fmtTokens(r.speed.prompt)} prompt)`, sp.ttft_s);
  show("tpot", fmtTime(sp.decode[0].tpot_s), sp.decode[0].tpot_s);
  show("tokens-per-s", comma(sp.decode[0].tokens_per_s, 1) + (sp.decode[0].fits ? "" : " (!)"),
    sp.decode[0].tokens_per_s);
  verdict(mem);
  warnings(r);
  compareTable(r);
  memoryChart(r);
  speedCharts(r);
  rooflineChart(r);
  layers(mem);
  simulate(r);
  $("commands").textContent = r.commands.join("\n");
  const url = `${location.origin}/?${r.query}`;
  $("link").href = url;
  $("link").textContent = url;
}

function longest(fit) {
  if (!fit.weights_fit) return ["none: the weights do not fit", null];
  if (fit.unbounded) return ["any (fixed state)", null];
  if (fit.max_context === null) return ["none", null];
  return [`${comma(fit.max_context)} tokens`, fit.max_context];
}

function verdict(mem) {  // kvwall memory's own line
  const d = mem.device;
  const el = $("fit-verdict");
  el.className = `verdict ${d.fits ? "yes" : "no"}`;
  el.textContent = `on ${d.name} (${gb(d.memory_bytes)} GB per GPU, 10% kept in reserve): ` +
    `${d.fits ? "fits" : "does NOT fit"}, ${fmtBytes(Math.abs(d.free_bytes))} ${d.fits ? "free" : "short"}`;
  el.dataset.fits = String(d.fits);
}

function warnings(r) {
  const lines = new Set(r.roofline.notes);
  for (const m of r.speed.models) if (m.fit_warning) lines.add(`warning: ${m.fit_warning}`);
  for (const m of r.models) {
    const d = m.memory.device;
    if (!d.fits) {
      lines.add(`${m.memory.model} does not fit ${d.name} at batch ${m.memory.batch} x ` +
        `${fmtTokens(m.memory.context)}: ${fmtBytes(-d.free_bytes)} short per GPU; add GPUs (tp), pick a smaller ` +
        "KV or weight format, a smaller batch or a shorter context");
    }
  }
  $("warnings").replaceChildren(...[...lines].map((t) => {
    const p = document.createElement("p");
    p.className = "warning";
    p.textContent = t;
    return p;
  }));
}

function table(el, head, rows) {
  const h = `<thead><tr>${head.map((c) => `<th>${esc(c)}</th>`).join("")}</tr></thead>`;
  el.innerHTML = h + `<tbody>${rows.map((r) => `<tr>${r.map((c) => `<td>${esc(c)}</td>`).join("")}</tr>`)
    .join("")}</tbody>`;
}

const esc = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

function compareTable(r) {
  const el = $("compare-table");
  el.hidden = r.models.length < 2;
  if (el.hidden) return;
  table(el, ["model", "cache/token", "per GPU", "fits", "longest ctx", "TTFT", `tok/s @${fmtTokens(r.context)}`],
    r.models.map((m, i) => {
      const s = r.speed.models[i];
      return [m.memory.model, fmtBytes(m.memory.cache_bytes_per_token), fmtBytes(m.memory.per_gpu.total_bytes),
        m.memory.device.fits ? "yes" : "no", longest(m.fit)[0], fmtTime(s.ttft_s),
        comma(s.decode[0].tokens_per_s, 1) + (s.decode[0].fits ? "" : " (!)")];
    }));
}

// no mode bar (it covers the titles): drag to zoom, double-click to reset; hovering shows each point's exact values
const PLOT_CONFIG = {displaylogo: false, responsive: true, displayModeBar: false};

function layout(title, xtitle, ytitle, xlog = true, ylog = false) {
  return {title: {text: title, font: {size: 13}, x: 0.01, xanchor: "left", y: 0.97, yanchor: "top", yref: "container"}, margin: {l: 60, r: 10, t: 56, b: 45},
    xaxis: {title: {text: xtitle}, type: xlog ? "log" : "linear"}, yaxis: {title: {text: ytitle}, type: ylog ? "log" : "linear"},
    legend: {orientation: "h", y: -0.25, font: {size: 10}}, hovermode: "closest"};
}

function memoryChart(r) {
  const traces = r.models.map((m) => ({name: m.memory.model, mode: "lines+markers", x: m.curve.map((p) => p.context),
    y: m.curve.map((p) => p.per_gpu_bytes / 1e9), customdata: m.curve.map((p) => [fmtBytes(p.per_gpu_bytes),
      comma(p.per_gpu_bytes)]),
    hovertemplate: "%{x:,} tokens: %{customdata[0]} (%{customdata[1]} B) per GPU<extra>%{fullData.name}</extra>"}));
  const d = r.models[0].memory.device;
  const xs = [r.models[0].curve[0].context, r.models[0].curve.at(-1).context];
  traces.push({name: `${d.name} memory`, mode: "lines", x: xs, y: [d.memory_bytes / 1e9, d.memory_bytes / 1e9],
    line: {color: "#c0392b"}, hovertemplate: `${gb(d.memory_bytes)} GB<extra></extra>`});
  const usable = d.memory_bytes - d.reserve_bytes;
  traces.push({name: "usable (10% reserve)", mode: "lines", x: xs, y: [usable / 1e9, usable / 1e9],
    line: {color: "#c0392b", dash: "dash"}, hovertemplate: `${gb(usable)} GB<extra></extra>`});
  for (const m of r.models) {
    if (m.fit.max_context) {
      traces.push({name: `${m.memory.model} fits up to`, mode: "markers", x: [m.fit.max_context], y: [usable / 1e9],
        marker: {symbol: "x", size: 12}, hovertemplate: `longest context: ${comma(m.fit.max_context)} tokens` +
          "<extra></extra>"});
    }
  }
  Plotly.react("chart-memory", traces, layout(`Memory per GPU vs context, batch ${r.models[0].memory.batch}<br>` +
    "<sup>weights + cache on the busiest GPU; x: the longest context that fits</sup>",
    "context (tokens)", "GB per GPU"), PLOT_CONFIG);
}

function band(r, key, scale, exact) {
  const traces = [];
  for (const m of r.speed.models) {
    const pts = (mode) => r.speed_curve[mode].map((p) => p[m.model]);
    for (const mode of ["expected", "ideal"]) {
      const p = pts(mode);
      traces.push({name: `${m.model} ${mode === "ideal" ? "ideal bound" : "expected"}`, mode: "lines+markers",
        x: p.map((q) => q.context), y: p.map((q) => q[key] * scale), fill: mode === "ideal" ? "tonexty" : "none",
        opacity: mode === "ideal" ? 0.5 : 1, line: {dash: mode === "ideal" ? "dot" : "solid"},
        customdata: p.map((q) => `${exact(q)}${q.fits ? "" : " (does not fit: a what-if)"}`),
        hovertemplate: "%{x:,} tokens: %{customdata}<extra>%{fullData.name}</extra>"});
    }
  }
  return traces;
}

function speedCharts(r) {
  const dev = r.speed.device;
  const decode = (q) => `${comma(q.tokens_per_s, 2)} tok/s (${fmtTime(q.tpot_s)} per token)`;
  Plotly.react("chart-speed", band(r, "tokens_per_s", 1, decode), layout(
    `Decode tok/s per sequence, ${dev}, batch ${r.speed.batch}<br><sup>band: expected up to the ideal bound</sup>`,
    "context (tokens)", "tokens/s per sequence", true, true), PLOT_CONFIG);
  Plotly.react("chart-ttft", band(r, "ttft_s", 1e3, (q) => `TTFT ${fmtTime(q.ttft_s)}`), layout(`TTFT vs prompt length, ${dev}<br>` +
    "<sup>band: expected down to the ideal bound</sup>", "prompt (tokens)", "TTFT (ms)", true, true), PLOT_CONFIG);
}

function opGroups(ops) {  // kvwall.report.analysis.group_ops: each op summed over the layers
  const g = new Map();
  for (const op of ops) {
    const key = op.name.startsWith("experts") ? op.name.split(" (")[0] : op.name;
    const s = g.get(key) || {name: key, flops: 0, bytes: 0, time_s: 0};
    s.flops += op.flops;
    s.bytes += op.bytes;
    s.time_s += op.time_s;
    g.set(key, s);
  }
  return [...g.values()].filter((s) => s.flops && s.bytes && s.time_s);
}

function rooflineChart(r) {
  const ph = r.roofline.phases[0];
  const {peak_flops: peak, bandwidth: bw} = r.roof;
  const xs = [0.1, peak / bw, 1e5];
  const traces = [{name: `roof (${r.roofline.mode}): ${comma(peak / 1e12)} TFLOP/s, ${comma(bw / 1e9)} GB/s`,
    mode: "lines", x: xs,
    y: xs.map((x) => Math.min(peak, bw * x)), line: {color: "#555"}, hoverinfo: "skip"}];
  for (const phase of [ph.prefill, ph.decode]) {
    const ops = opGroups(phase.ops);
    traces.push({name: `${phase.phase} ops`, mode: "markers", x: ops.map((o) => o.flops / o.bytes),
      y: ops.map((o) => o.flops / o.time_s), text: ops.map((o) => o.name), marker: {size: 9},
      customdata: ops.map((o) => [fmtTime(o.time_s), fmtBytes(o.bytes)]),
      hovertemplate: "%{text}: %{x:,.4~r} FLOP/B, %{y:.4~s}FLOP/s, %{customdata[0]}, %{customdata[1]} moved" +
        "<extra>%{fullData.name}</extra>"});
  }
  Plotly.react("chart-roofline", traces, layout(`Roofline of ${r.roofline.model}, batch ${ph.batch}<br>` +
    `<sup>each op summed over the layers: prefill of ${fmtTokens(r.roofline.prompt)}, decode at ` +
    `${fmtTokens(r.roofline.context)}</sup>`,
    "arithmetic intensity (FLOP/byte)", "FLOP/s", true, true), PLOT_CONFIG);
}

function layers(mem) {
  const kinds = new Map();
  for (const l of mem.layers) {
    const k = kinds.get(l.kind) || [0, 0, 0, 0];
    k[0] += 1; k[1] += l.token_bytes; k[2] += l.cache_bytes; k[3] += l.fixed_bytes;
    kinds.set(l.kind, k);
  }
  table($("layers"), ["kind", "layers", "B/token", "cache", "state/seq"],
    [...kinds].map(([kind, [n, tb, cb, fb]]) => [kind, n, comma(tb), fmtBytes(cb), fmtBytes(fb)]));
  table($("layers-all"), ["layer", "kind", "weights", "B/token", "tokens held", "cache", "state/seq"],
    mem.layers.map((l) => [l.index, l.kind, fmtBytes(l.weight_bytes), comma(l.token_bytes), comma(l.tokens_held),
      fmtBytes(l.cache_bytes), fmtBytes(l.fixed_bytes)]));
}

function simulate(r) {
  $("simulate").hidden = !r.simulate;
  if (!r.simulate) return;
  const p = r.simulate.points[0];
  $("sim-rate").textContent = String(p.rate);
  const stat = (s) => (s ? ["mean", "p50", "p90", "p99"].map((k) => fmtTime(s[k])) : ["-", "-", "-", "-"]);
  const rows = [["TTFT", ...stat(p.ttft_s)], ["time per output token", ...stat(p.tpot_s)]];
  table($("sim-table"), ["", "mean", "p50", "p90", "p99"], rows);
  const extra = document.createElement("tbody");
  const pool = p.pool;
  extra.innerHTML = [
    ["completed", `${p.completed} requests in ${comma(p.duration_s, 1)} s`],
    ["throughput", `${comma(p.request_throughput, 2)} req/s, ${comma(p.output_token_throughput, 0)} output tok/s`],
    ["KV pool", `${comma(pool.n_blocks)} blocks of ${pool.block_size} tokens ` +
      `(${fmtBytes(pool.n_blocks * pool.block_bytes)} per GPU)`],
    ["preemptions", String(p.preemptions)],
  ].map(([k, v]) => `<tr><td>${esc(k)}</td><td colspan="4" id="sim-${k.replace(/ /g, "-")}">${esc(v)}</td></tr>`)
    .join("");
  $("sim-table").append(extra);
}

// -- start ----------------------------------------------------------------------------------------------------------

async function start() {
  options = await (await fetch("/api/options")).json();
  OPTS = options.options.filter((k) => k !== "model");
  for (const m of options.models) {
    $("model").add(new Option(m, m));
    $("compare").add(new Option(m, m));
  }
  for (const d of options.devices) $("device").add(new Option(d, d));
  for (const f of options.formats) $("formats").append(new Option(f, f));
  const q = new URLSearchParams(location.search);
  if (!q.has("model")) q.set("model", "llama-3-8b");
  writeForm(q);
  $("form").addEventListener("input", schedule);
  $("form").addEventListener("change", schedule);
  $("config-clear").addEventListener("click", () => { $("config").value = ""; schedule(); });
  $("config-file").addEventListener("change", upload);
  update();
}

async function upload() {
  const file = $("config-file").files[0];
  if (!file) return;
  if (file.name.toLowerCase().endsWith(".gguf")) {
    const r = await fetch("/api/gguf", {method: "POST", body: await file.arrayBuffer()});
    const body = await r.json();
    if (body.error) {
      $("error").textContent = `kvwall: error: ${body.error}`;
      $("error").hidden = false;
      return;
    }
    $("config").value = JSON.stringify(body.config, null, 1);
  } else {
    $("config").value = await file.text();
  }
  schedule();
}

start();
