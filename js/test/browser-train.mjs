// node js/test/browser-train.mjs ARTIFACT_DIR --data batches.npz --steps N --out state.safetensors
//
// The CLI's training, run in headless Chromium with onnxruntime-web (WebAssembly): the page
// js/test/browser/index.html and the files it fetches are served from disk through Playwright's request
// interception (no server, no port), under an origin of their own. Prints the CLI's lines, then
// "seconds <s>" (the training loop's time in the page) on stderr. CHROMIUM names the browser (default
// /usr/bin/chromium).

import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

import { chromium } from "playwright-core";

const ORIGIN = "http://aot2onnx.test";
const JS_DIR = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const TYPES = { ".html": "text/html", ".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm",
  ".json": "application/json" };

/** Serves `mounts` ({url prefix: file or directory}) to the page; everything else is refused. */
export async function serve(page, mounts) {
  await page.route(`${ORIGIN}/**`, async (route) => {
    const { pathname } = new URL(route.request().url());
    for (const [prefix, target] of Object.entries(mounts)) {
      if (pathname !== prefix && !pathname.startsWith(prefix.endsWith("/") ? prefix : `${prefix}/`)) continue;
      const file = path.join(target, decodeURIComponent(pathname.slice(prefix.length)));
      if (!file.startsWith(target) || !fs.existsSync(file) || !fs.statSync(file).isFile()) break;
      return route.fulfill({ status: 200, body: fs.readFileSync(file),
        headers: { "content-type": TYPES[path.extname(file)] || "application/octet-stream" } });
    }
    return route.fulfill({ status: 404, body: "not found" });
  });
}

export async function launch() {
  const executablePath = process.env.CHROMIUM || "/usr/bin/chromium";
  // --no-sandbox: the tests run as root, where Chromium's sandbox does not start.
  return chromium.launch({ executablePath, args: ["--no-sandbox"] });
}

async function main(argv) {
  const get = (flag) => argv[argv.indexOf(flag) + 1];
  const artifact = path.resolve(argv[0]);
  const data = path.resolve(get("--data"));
  const steps = Number(get("--steps"));
  const out = get("--out");
  const browser = await launch();
  try {
    const page = await browser.newPage();
    page.on("console", (m) => { if (m.type() === "error") process.stderr.write(`[page] ${m.text()}\n`); });
    page.on("pageerror", (e) => process.stderr.write(`[page] ${e.message}\n`));
    await serve(page, { "/js": JS_DIR, "/artifact": artifact, "/data.npz": data });
    await page.goto(`${ORIGIN}/js/test/browser/index.html`);
    await page.waitForFunction(() => window.ready === true);
    const result = await page.evaluate(([a, d, n]) => window.train(a, d, n), [`${ORIGIN}/artifact/`, `${ORIGIN}/data.npz`, steps]);
    process.stdout.write(result.lines.map((l) => `${l}\n`).join(""));
    fs.writeFileSync(out, Buffer.from(result.state, "base64"));
    process.stderr.write(`seconds ${result.seconds}\n`);
  } finally {
    await browser.close();
  }
}

if (process.argv[1] && fileURLToPath(import.meta.url) === path.resolve(process.argv[1])) {
  await main(process.argv.slice(2));
}
