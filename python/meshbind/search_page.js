// The layout search's page (meshbind plan --html): peak memory against speed, the best layouts, what fell out.
const search = JSON.parse(document.getElementById("search-data").textContent);
const units = ["B", "KiB", "MiB", "GiB", "TiB"];
function size(bytes) {
  let value = bytes, unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return unit === 0 ? bytes + " B" : value.toFixed(value < 10 ? 2 : 1) + " " + units[unit];
}
const count = value => value.toLocaleString("en", { maximumFractionDigits: 0 });
const svgNS = "http://www.w3.org/2000/svg";
document.getElementById("heading").textContent = search.heading;

function element(name, attributes, into) {
  const made = document.createElementNS(svgNS, name);
  for (const [key, value] of Object.entries(attributes)) made.setAttribute(key, value);
  into.append(made);
  return made;
}

// Every layout that fits as a point; the front joined left to right; the device's memory as a line.
const plot = document.getElementById("front");
if (search.points.length === 0) {
  plot.textContent = "No layout fits: see what was left out, below.";
} else {
  const width = 780, height = 380, left = 95, right = 40, top = 15, bottom = 45;
  // The device's memory is drawn where the peaks come near it; else the peaks fill the width.
  const highest = Math.max(...search.points.map(p => p.peak_bytes));
  const showDevice = search.device_memory <= 1.5 * highest;
  const most = showDevice ? search.device_memory * 1.05 : highest * 1.1;
  const fastest = Math.max(...search.points.map(p => p.tokens_per_second_per_gpu)) * 1.05;
  const x = bytes => left + (bytes / most) * (width - left - right);
  const y = tokens => height - bottom - (tokens / fastest) * (height - top - bottom);
  const svg = element("svg", { width, height, viewBox: `0 0 ${width} ${height}` }, plot);
  element("line", { x1: left, y1: height - bottom, x2: width - right, y2: height - bottom, class: "axis" }, svg);
  element("line", { x1: left, y1: top, x2: left, y2: height - bottom, class: "axis" }, svg);
  for (let tick = 0; tick <= 4; tick += 1) {
    const bytes = (most * tick) / 4, tokens = (fastest * tick) / 4;
    element("text", { x: x(bytes), y: height - bottom + 16, "text-anchor": "middle" }, svg).textContent = size(Math.round(bytes));
    element("text", { x: left - 6, y: y(tokens) + 4, "text-anchor": "end" }, svg).textContent = count(tokens);
  }
  element("text", { x: (left + width - right) / 2, y: height - 8, "text-anchor": "middle" }, svg).textContent = "peak memory per GPU" + (showDevice ? "" : ` (the device's ${size(search.device_memory)} is far to the right)`);
  element("text", { x: 14, y: (top + height - bottom) / 2, "text-anchor": "middle", transform: `rotate(-90 14 ${(top + height - bottom) / 2})` }, svg).textContent = "tokens/s per GPU";
  if (showDevice) {
    const device = x(search.device_memory);
    element("line", { x1: device, y1: top, x2: device, y2: height - bottom, class: "device" }, svg);
    element("text", { x: device - 4, y: top + 12, "text-anchor": "end" }, svg).textContent = "device memory";
  }
  const front = search.points.filter(p => p.front).sort((a, b) => a.peak_bytes - b.peak_bytes);
  element("polyline", { points: front.map(p => `${x(p.peak_bytes)},${y(p.tokens_per_second_per_gpu)}`).join(" "), class: "front" }, svg);
  search.points.forEach((p, index) => {
    const point = element("circle", { cx: x(p.peak_bytes), cy: y(p.tokens_per_second_per_gpu), r: p.front ? 4 : 2.5, class: p.front ? "point front" : "point" }, svg);
    point.dataset.rank = index + 1;
    const mfu = p.mfu === null ? "" : `, MFU ${(p.mfu * 100).toFixed(1)}%`;
    element("title", {}, point).textContent = `#${index + 1} ${p.layout}: ${size(p.peak_bytes)}, ${count(p.tokens_per_second_per_gpu)} tokens/s/GPU${mfu}`;
  });
}

// The best layouts, each with the check that gives its figures.
const ranked = document.getElementById("ranked");
const header = ranked.createTHead().insertRow();
for (const name of ["#", "tokens/s/GPU", "MFU", "step", "peak", "layout", "check it with"]) header.insertCell().textContent = name;
const body = ranked.createTBody();
search.points.slice(0, search.top).forEach((p, index) => {
  const row = body.insertRow();
  row.dataset.rank = index + 1;
  row.insertCell().textContent = index + 1;
  row.insertCell().textContent = count(p.tokens_per_second_per_gpu);
  row.insertCell().textContent = p.mfu === null ? "?" : (p.mfu * 100).toFixed(1) + "%";
  row.insertCell().textContent = (p.step_s * 1e3).toFixed(2) + " ms";
  row.insertCell().textContent = size(p.peak_bytes);
  row.insertCell().textContent = p.layout;
  const command = document.createElement("code");
  command.textContent = search.commands[index] || "";
  row.insertCell().append(command);
});

const leftOut = document.getElementById("left-out");
for (const [rule, number] of search.left_out) {
  const row = leftOut.insertRow();
  row.insertCell().textContent = count(number);
  row.insertCell().textContent = rule;
}
