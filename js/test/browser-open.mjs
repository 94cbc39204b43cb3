// node js/test/browser-open.mjs DIR... : opens each artifact with the browser reader (onnxruntime-web in
// headless Chromium; each directory served under a URL of its own) and prints one JSON line per directory:
// {dir, ok, error, message}, as js/test/open-artifacts.mjs does for Node.

import path from "node:path";
import { fileURLToPath } from "node:url";

import { launch, serve } from "./browser-train.mjs";

const ORIGIN = "http://aot2onnx.test";
const dirs = process.argv.slice(2);
const browser = await launch();
try {
  const page = await browser.newPage();
  const mounts = { "/js": path.dirname(path.dirname(fileURLToPath(import.meta.url))) };
  dirs.forEach((dir, i) => { mounts[`/a${i}`] = path.resolve(dir); });
  await serve(page, mounts);
  await page.goto(`${ORIGIN}/js/test/browser/index.html`);
  await page.waitForFunction(() => window.ready === true);
  for (const [i, dir] of dirs.entries()) {
    const result = await page.evaluate((url) => window.open_(url), `${ORIGIN}/a${i}/`);
    console.log(JSON.stringify({ dir, ...result }));
  }
} finally {
  await browser.close();
}
