// The demo page: opens the exported moons classifier, makes its data, trains it and plots the loss.

import * as ort from "onnxruntime-web";

import { openTrainer, stateBlobUrl } from "../src/browser.mjs";

const params = new URLSearchParams(location.search);
const ARTIFACT = params.get("artifact") || "./artifact/";
const STEPS = Number(params.get("steps") || 300);
const BATCH = 32;
const POINTS = 512;

ort.env.wasm.numThreads = 1; // worker threads need a cross-origin-isolated page; one thread is plenty here
ort.env.wasm.wasmPaths = new URL("../node_modules/onnxruntime-web/dist/", import.meta.url).href;

const status = document.getElementById("status");

/** A seeded generator of uniform numbers in [0, 1) (mulberry32), so every visit trains on the same points. */
function uniform(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Two interleaved half-moons with noise: points [n, 2] (float32) and labels [n] (int64). */
function moons(n, random) {
  const points = new Float32Array(2 * n);
  const labels = new BigInt64Array(n);
  const normal = () => Math.sqrt(-2 * Math.log(1 - random())) * Math.cos(2 * Math.PI * random());
  for (let i = 0; i < n; i++) {
    const upper = i % 2 === 0;
    const angle = Math.PI * random();
    const [x, y] = upper ? [Math.cos(angle), Math.sin(angle)] : [1 - Math.cos(angle), 0.5 - Math.sin(angle)];
    points[2 * i] = x - 0.5 + 0.12 * normal();
    points[2 * i + 1] = y - 0.25 + 0.12 * normal();
    labels[i] = upper ? 0n : 1n;
  }
  return { points, labels };
}

function drawData({ points, labels }) {
  const canvas = document.getElementById("data");
  const g = canvas.getContext("2d");
  g.fillStyle = "#fff";
  g.fillRect(0, 0, canvas.width, canvas.height);
  for (let i = 0; i < labels.length; i++) {
    g.fillStyle = labels[i] === 0n ? "#1f77b4" : "#ff7f0e";
    g.beginPath();
    g.arc(180 + 100 * points[2 * i], 180 - 100 * points[2 * i + 1], 3, 0, 2 * Math.PI);
    g.fill();
  }
}

const LINE = "#d6336c"; // the loss curve's colour (tests/test_js_demo.py looks for it in the screenshot)

function drawLoss(losses, total) {
  const canvas = document.getElementById("loss");
  const g = canvas.getContext("2d");
  const [left, right, top, bottom] = [60, canvas.width - 20, 20, canvas.height - 40];
  g.fillStyle = "#fff";
  g.fillRect(0, 0, canvas.width, canvas.height);
  const high = Math.max(...losses.slice(0, 20), 1e-3) * 1.1;
  g.strokeStyle = "#999";
  g.lineWidth = 1;
  g.beginPath();
  g.moveTo(left, top);
  g.lineTo(left, bottom);
  g.lineTo(right, bottom);
  g.stroke();
  g.fillStyle = "#444";
  g.font = "12px sans-serif";
  g.textAlign = "right";
  for (let k = 0; k <= 4; k++) {
    const value = (high * k) / 4;
    const y = bottom - ((bottom - top) * k) / 4;
    g.fillText(value.toFixed(2), left - 6, y + 4);
  }
  g.textAlign = "center";
  g.fillText("step", (left + right) / 2, canvas.height - 8);
  for (let k = 0; k <= 5; k++) g.fillText(String(Math.round((total * k) / 5)), left + ((right - left) * k) / 5, bottom + 16);
  g.save();
  g.translate(16, (top + bottom) / 2);
  g.rotate(-Math.PI / 2);
  g.fillText("loss", 0, 0);
  g.restore();
  g.strokeStyle = LINE;
  g.lineWidth = 2;
  g.beginPath();
  losses.forEach((loss, i) => {
    const x = left + ((right - left) * (i + 1)) / total;
    const y = bottom - (bottom - top) * Math.min(loss / high, 1);
    if (i === 0) g.moveTo(x, y);
    else g.lineTo(x, y);
  });
  g.stroke();
}

async function main() {
  const data = moons(POINTS, uniform(1));
  drawData(data);
  status.textContent = `loading the model from ${ARTIFACT}…`;
  const trainer = await openTrainer(ARTIFACT, ort);
  const random = uniform(2);
  const points = new Float32Array(2 * BATCH);
  const labels = new BigInt64Array(BATCH);
  const losses = [];
  const started = performance.now();
  for (let step = 0; step < STEPS; step++) {
    for (let b = 0; b < BATCH; b++) { // a batch of random points
      const i = Math.floor(random() * POINTS);
      points[2 * b] = data.points[2 * i];
      points[2 * b + 1] = data.points[2 * i + 1];
      labels[b] = data.labels[i];
    }
    losses.push(await trainer.step({ dtype: "float32", shape: [BATCH, 2], data: points },
      { dtype: "int64", shape: [BATCH], data: labels }));
    if (step % 10 === 9 || step === STEPS - 1) {
      drawLoss(losses, STEPS);
      const rate = (step + 1) / ((performance.now() - started) / 1000);
      status.textContent = `step ${step + 1}/${STEPS}  loss ${losses[losses.length - 1].toFixed(4)}  ` +
        `(${rate.toFixed(0)} steps/s, lr ${trainer.hyperparameter("lr").toExponential(2)})`;
      await new Promise(requestAnimationFrame); // let the page paint
    }
  }
  const link = document.createElement("a");
  link.href = stateBlobUrl(trainer);
  link.download = "trained.safetensors";
  link.textContent = "download the trained state (state.safetensors layout)";
  document.getElementById("download").append(link);
  status.textContent = `done: ${STEPS} steps, loss ${losses[0].toFixed(4)} → ${losses[losses.length - 1].toFixed(4)}`;
  window.demoLosses = losses;
  document.body.dataset.state = "done";
}

main().catch((e) => {
  status.textContent = `error: ${e.message}`;
  status.className = "error";
  document.body.dataset.state = "error";
  console.error(e);
});
