// The browser entry point: the trainer with onnxruntime-web, the artifact fetched from a URL. The page passes
// the onnxruntime-web module it loaded (ort.wasm.min.mjs for WebAssembly; ort.webgpu.min.mjs with
// executionProviders: ["webgpu", "wasm"] where the browser has WebGPU).

import { readNpz } from "./npy.mjs";
import { Trainer } from "./trainer.mjs";
import { urlStore } from "./url-store.mjs";

export * from "./index.mjs";

/** A Trainer for the artifact at `url` (a directory URL: signature.json, the models and the state under it). */
export function openTrainer(url, ort, options = {}) {
  return Trainer.open(urlStore(url), ort, options);
}

/** Every array of the .npz file at `url`. */
export async function fetchNpz(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url} cannot be fetched: HTTP ${response.status}`);
  return readNpz(new Uint8Array(await response.arrayBuffer()), url);
}

/** A Blob URL of the trainer's state as a state.safetensors file, for a download link. */
export function stateBlobUrl(trainer) {
  return URL.createObjectURL(new Blob([trainer.saveBytes()], { type: "application/octet-stream" }));
}
