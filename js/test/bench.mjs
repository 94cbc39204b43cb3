// node js/test/bench.mjs ARTIFACT_DIR --data batches.npz [--threads T] [--browser]
//
// The JavaScript trainer as a timing worker for scripts/bench_js.py: opens the artifact once (in Node with
// onnxruntime-node, or with --browser in headless Chromium with onnxruntime-web, WebAssembly, one thread), then
// for each line "N" read from stdin trains N steps and prints the loop's seconds (no process start, no session
// creation). Long-lived, so that the Python reader and this one can take turns in short blocks on a busy machine.

import path from "node:path";
import readline from "node:readline";
import { fileURLToPath } from "node:url";

import { launch, serve } from "./browser-train.mjs";
import { batchAt, loadNpz, openTrainer, orderBatches } from "../src/node.mjs";

const argv = process.argv.slice(2);
const get = (flag, fallback) => (argv.includes(flag) ? argv[argv.indexOf(flag) + 1] : fallback);
const artifact = path.resolve(argv[0]);
const data = path.resolve(get("--data"));

async function nodeRunner() {
  const trainer = await openTrainer(artifact, { threads: Number(get("--threads", "0")) });
  const batches = orderBatches(loadNpz(data), trainer.signature.user_inputs, data);
  const count = batches[0].shape[0];
  let step = 0;
  return {
    async run(n) {
      const started = process.hrtime.bigint();
      for (let i = 0; i < n; i++, step++) await trainer.step(...batchAt(batches, step % count));
      return Number(process.hrtime.bigint() - started) / 1e9;
    },
    close: () => trainer.release(),
  };
}

async function browserRunner() {
  const ORIGIN = "http://aot2onnx.test";
  const chromium = await launch();
  const page = await chromium.newPage();
  await serve(page, { "/js": path.dirname(path.dirname(fileURLToPath(import.meta.url))), "/artifact": artifact, "/data.npz": data });
  await page.goto(`${ORIGIN}/js/test/browser/index.html`);
  await page.waitForFunction(() => window.ready === true);
  await page.evaluate(([a, d]) => window.benchOpen(a, d), [`${ORIGIN}/artifact/`, `${ORIGIN}/data.npz`]);
  return { run: (n) => page.evaluate((k) => window.benchRun(k), n), close: () => chromium.close() };
}

const runner = argv.includes("--browser") ? await browserRunner() : await nodeRunner();
console.log(JSON.stringify({ ready: true }));
for await (const line of readline.createInterface({ input: process.stdin })) {
  if (!line.trim()) continue;
  console.log(JSON.stringify({ seconds: await runner.run(Number(line)) }));
}
await runner.close();
