// node js/test/demo-screenshot.mjs ARTIFACT_DIR --out shot.png [--steps N]
//
// Opens the demo page (js/demo/index.html) in headless Chromium with ARTIFACT_DIR as its ./artifact/, waits
// until it has trained, writes a screenshot of the page and prints {state, status, losses} as JSON.

import path from "node:path";
import { fileURLToPath } from "node:url";

import { launch, serve } from "./browser-train.mjs";

const ORIGIN = "http://aot2onnx.test";
const argv = process.argv.slice(2);
const get = (flag, fallback) => (argv.includes(flag) ? argv[argv.indexOf(flag) + 1] : fallback);
const jsDir = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const browser = await launch();
try {
  const page = await browser.newPage({ viewport: { width: 1180, height: 560 } });
  page.on("pageerror", (e) => process.stderr.write(`[page] ${e.message}\n`));
  await serve(page, { "/js/demo/artifact": path.resolve(argv[0]), "/js": jsDir });
  await page.goto(`${ORIGIN}/js/demo/index.html?steps=${get("--steps", "300")}`);
  await page.waitForSelector("body[data-state]", { timeout: 240_000 });
  await page.screenshot({ path: get("--out"), fullPage: true });
  const result = await page.evaluate(() => ({ state: document.body.dataset.state,
    status: document.getElementById("status").textContent, losses: window.demoLosses || [] }));
  console.log(JSON.stringify(result));
} finally {
  await browser.close();
}
