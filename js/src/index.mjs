// What Node and a browser share: the format's checks, safetensors, numpy's .npy/.npz, and the Trainer (which
// takes ONNX Runtime as an argument). src/node.mjs and src/browser.mjs bind it to a runtime.

export { ArtifactError, FORMAT, READABLE_FORMATS, checkSignature, formatFloat, lrFactor } from "./format.mjs";
export { openArtifact } from "./artifact.mjs";
export { readSafetensors, writeSafetensors } from "./safetensors.mjs";
export { readNpy, readNpz } from "./npy.mjs";
export { Trainer, batchAt, orderBatches, sessionOptions } from "./trainer.mjs";
export { urlStore } from "./url-store.mjs";
