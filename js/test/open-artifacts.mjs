// node js/test/open-artifacts.mjs DIR... : opens each artifact with the Node trainer (every check, then the
// three ONNX Runtime sessions) and prints one JSON line per directory: {dir, ok, error, message}. One process
// for many artifacts: tests/test_js_trainer.py's refusal cases run here in one go.

import { openTrainer } from "../src/node.mjs";

for (const dir of process.argv.slice(2)) {
  try {
    const trainer = await openTrainer(dir);
    await trainer.release();
    console.log(JSON.stringify({ dir, ok: true }));
  } catch (e) {
    console.log(JSON.stringify({ dir, ok: false, error: e.name, message: e.message }));
  }
}
