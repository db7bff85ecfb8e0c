// The plan report page's drawing (meshbind check --html): the tree, the totals and the bars.
const report = JSON.parse(document.getElementById("report-data").textContent);
const units = ["B", "KiB", "MiB", "GiB", "TiB"];
function size(bytes) {
  let value = bytes, unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return unit === 0 ? bytes + " B" : value.toFixed(1) + " " + units[unit];
}
const palette = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d"];
const protocols = [...new Set(report.params.map(p => p.protocol).filter(p => p !== null))];
const colour = p => p === null ? "#bbb" : palette[protocols.indexOf(p) % palette.length];

const totals = document.getElementById("totals");
for (const [name, value] of Object.entries(report.totals)) {
  const row = totals.insertRow();
  row.insertCell().textContent = name;
  const cell = row.insertCell();
  cell.textContent = String(value);
  cell.dataset.total = name;
  row.insertCell().textContent = name.endsWith("bytes") || name.includes("bytes_") ? size(value) : "";
}

const legend = document.getElementById("legend");
for (const p of [...protocols, null]) {
  const item = document.createElement("span");
  item.innerHTML = `<span class="swatch" style="background:${colour(p)}"></span>`;
  item.append((p === null ? "not planned" : p) + "   ");
  legend.append(item);
}

// The report's groups: parameters that differ only in a layer index are one node ("layers.<0-47>").
const root = { children: new Map(), params: [] };
for (const group of report.groups) {
  const parts = group.fqn.split(".");
  let node = root;
  for (const part of parts.slice(0, -1)) {
    if (!node.children.has(part)) node.children.set(part, { children: new Map(), params: [] });
    node = node.children.get(part);
  }
  node.params.push({ name: parts[parts.length - 1], count: group.members.length, row: report.params[group.members[0]] });
}
function draw(node, into) {
  for (const [name, child] of node.children) {
    const details = document.createElement("details");
    const summary = document.createElement("summary");
    const protocol = firstProtocol(child);
    summary.innerHTML = `<span class="swatch" style="background:${colour(protocol)}"></span>`;
    summary.append(name);
    details.append(summary);
    draw(child, details);
    into.append(details);
  }
  for (const p of node.params) {
    const line = document.createElement("div");
    line.className = "param";
    line.innerHTML = `<span class="swatch" style="background:${colour(p.row.protocol)}"></span>`;
    line.append(`${p.count > 1 ? p.count + " × " : ""}${p.name}  ${size(p.row.bytes_per_rank)} per rank`);
    const placements = Object.entries(p.row.placements).map(([axis, placement]) => `${axis}: ${placement}`).join(", ") || "whole on every rank";
    line.title = `${placements}; global ${JSON.stringify(p.row.shape)}, local ${JSON.stringify(p.row.local_shape)}`;
    const info = document.createElement("div");
    info.className = "info";
    info.textContent = `${placements} · global shape ${JSON.stringify(p.row.shape)} · local shape ${JSON.stringify(p.row.local_shape)} · ${p.row.dtype}`;
    line.addEventListener("click", () => line.classList.toggle("open"));
    into.append(line, info);
  }
}
function firstProtocol(node) {
  for (const p of node.params) if (p.row.protocol !== null) return p.row.protocol;
  for (const child of node.children.values()) { const found = firstProtocol(child); if (found !== null) return found; }
  return null;
}
draw(root, document.getElementById("tree"));

// A bar: its data attributes, a label, and one piece per [class, bytes, title] on a scale of `widest` bytes.
function drawBar(into, data, labelText, pieces, widest, tail, amount = size) {
  const bar = document.createElement("div");
  bar.className = "bar";
  Object.assign(bar.dataset, data);
  const label = document.createElement("span");
  label.className = "label";
  label.textContent = labelText;
  bar.append(label);
  for (const [className, bytes, title] of pieces) {
    const piece = document.createElement("div");
    piece.className = className;
    piece.style.width = (60 * bytes / widest) + "%";
    piece.title = `${title}: ${amount(bytes)}`;
    bar.append(piece);
  }
  bar.append(" " + tail);
  into.append(bar);
  return bar;
}

const bars = document.getElementById("bars");
const largest = Math.max(...report.rank_groups.map(g => g.total_bytes), 1);
for (const rank of report.rank_groups) {
  // Under a pipeline each group is one pipeline rank's ranks, holding the stages it runs.
  const stages = rank.stages.length === 0 ? "" : `, ${rank.stages.length > 1 ? "stages" : "stage"} ${rank.stages.join(", ")}`;
  const label = rank.count === 1 ? `rank ${rank.first} ${JSON.stringify(rank.first_coordinates)}${stages}`
    : `ranks ${rank.first}–${rank.first + rank.count - 1} (${rank.count.toLocaleString()} ranks, each the same${stages})`;
  const pieces = [["parameters", rank.parameter_bytes], ["gradients", rank.gradient_bytes], ["optimizer", rank.optimizer_bytes]];
  drawBar(bars, {first: String(rank.first), count: String(rank.count), total: String(rank.total_bytes),
    stages: rank.stages.join(",")}, label, pieces.map(([kind, bytes]) => [kind, bytes, kind]), largest, size(rank.total_bytes));
}

// The FSDP units, alike ones as one row: the dtypes each is held, gathered and reduced in, and its buffers.
const unitsTable = document.getElementById("units");
if (report.units.length === 0) {
  document.getElementById("units-section").remove();
} else {
  const header = unitsTable.insertRow();
  for (const title of ["unit", "mesh", "held in → gathered in", "reduced in", "shards", "gathered copy", "reduce-scatter"]) {
    header.insertCell().textContent = title;
  }
  for (const unit of report.units) {
    const row = unitsTable.insertRow();
    row.dataset.fqn = unit.fqn;
    row.dataset.bytes = [unit.shard_bytes, unit.gathered_bytes, unit.reduce_scatter_bytes].join(",");
    const cells = [(unit.count > 1 ? unit.count + " × " : "") + unit.fqn, unit.mesh, `${unit.dtype} → ${unit.param_dtype}`,
      unit.reduce_dtype, size(unit.shard_bytes), size(unit.gathered_bytes), size(unit.reduce_scatter_bytes)];
    for (const text of cells) row.insertCell().textContent = text;
  }
}

// With --memory: one bar per class of ranks, the bytes live at the step's peak by kind, on the
// scale of the device's memory when it was given.
const memory = JSON.parse(document.getElementById("memory-data").textContent);
if (memory === null) {
  document.getElementById("memory-section").remove();
} else {
  document.getElementById("memory-step").textContent = `batch ${memory.batch_per_rank} x seq ${memory.seq_len} per data-parallel rank on ${memory.device}, optimizer ${memory.optimizer}, activation checkpointing ${memory.activation_checkpointing}` +
    (memory.device_memory === null ? "" : memory.fits ? ` — fits ${size(memory.device_memory)}` : ` — does NOT fit ${size(memory.device_memory)}: ${size(memory.shortfall_bytes)} more needed`);
  const widest = Math.max(memory.peak_bytes, memory.device_memory || 0, 1);
  const into = document.getElementById("memory");
  for (const rankClass of memory.rank_classes) {
    const kinds = Object.keys(rankClass.live_at_peak);
    const live = Object.entries(rankClass.live_at_peak).filter(([, bytes]) => bytes > 0);
    const label = rankClass.ranks === 1 ? `rank ${rankClass.first_rank}` : `ranks ${rankClass.first_rank}–${rankClass.first_rank + rankClass.ranks - 1}`;
    const bar = drawBar(into, {first: String(rankClass.first_rank), count: String(rankClass.ranks), peak: String(rankClass.peak_bytes)},
      label, live.map(([kind, bytes]) => ["kind", bytes, kind.replaceAll("_", " ")]), widest,
      `${size(rankClass.peak_bytes)} at ${rankClass.peak_module} ${rankClass.peak_phase}`);
    bar.classList.add("step");
    // Each kind keeps its colour across rank classes: its place in the kinds' fixed order.
    bar.querySelectorAll(".kind").forEach((piece, index) => {
      piece.dataset.kind = live[index][0];
      piece.style.background = `hsl(${(kinds.indexOf(live[index][0]) * 47) % 360}, 55%, 55%)`;
    });
  }
}

// With --step-time: one bar per class of ranks, its step as compute, the waits on each axis's
// collectives and the pipeline's bubble, on the scale of the slowest class's step.
const timed = JSON.parse(document.getElementById("time-data").textContent);
if (timed === null) {
  document.getElementById("time-section").remove();
} else {
  const seconds = s => s >= 1 ? `${s.toFixed(2)} s` : s >= 1e-3 ? `${(s * 1e3).toFixed(1)} ms` : `${Math.round(s * 1e6)} µs`;
  document.getElementById("time-step").textContent = `on ${timed.cluster.gpu.name}, ${timed.cluster.gpus_per_node} per node: step ${seconds(timed.step_s)}, ` +
    `${Math.round(timed.tokens_per_second_per_gpu).toLocaleString("en")} tokens/s per GPU` + (timed.mfu === null ? "" : `, MFU ${(100 * timed.mfu).toFixed(1)}%`);
  const into = document.getElementById("time");
  const axes = [...new Set(timed.rank_classes.flatMap(c => Object.keys(c.exposed_s)))];
  for (const rankClass of timed.rank_classes) {
    const exposed = Object.entries(rankClass.exposed_s).filter(([, s]) => s > 0);
    const pieces = [["compute", rankClass.compute_s, "compute"], ...exposed.map(([axis, s]) => ["exposed", s, `waiting on ${axis}`]),
      ["bubble", rankClass.bubble_s, "bubble"]].filter(([, s]) => s > 0);
    const label = rankClass.ranks === 1 ? `rank ${rankClass.first_rank}` : `ranks ${rankClass.first_rank}–${rankClass.first_rank + rankClass.ranks - 1}`;
    const bar = drawBar(into, {first: String(rankClass.first_rank), count: String(rankClass.ranks), step: String(rankClass.step_s)},
      label, pieces, timed.step_s, seconds(rankClass.step_s), seconds);
    bar.classList.add("step");
    // Each axis keeps its colour across rank classes.
    bar.querySelectorAll(".exposed").forEach((piece, index) => {
      const axis = exposed[index][0];
      piece.dataset.axis = axis;
      piece.style.background = `hsl(${(axes.indexOf(axis) * 67 + 20) % 360}, 60%, 55%)`;
    });
  }
}
