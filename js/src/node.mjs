// The Node entry point: the trainer with onnxruntime-node and an artifact directory on disk.

import fs from "node:fs";

import * as ort from "onnxruntime-node";

import { nodeStore } from "./node-store.mjs";
import { readNpz } from "./npy.mjs";
import { Trainer } from "./trainer.mjs";

export * from "./index.mjs";
export { nodeStore };

/** A Trainer for the artifact directory `dir` ({threads}: ONNX Runtime's intra-op threads, 0 its default). */
export function openTrainer(dir, options = {}) {
  return Trainer.open(nodeStore(dir), ort, options);
}

/** Every array of an .npz file on disk. */
export function loadNpz(path) {
  const bytes = fs.readFileSync(path);
  return readNpz(new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength), path);
}
