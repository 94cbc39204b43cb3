// Opening an artifact: every refusal of docs/artifact-format.md ("What a reader must refuse"), made before
// ONNX Runtime opens a model. The models' inputs, outputs and embedded signatures are read from their protobuf,
// so the checks are the same in Node and in a browser.

import {
  ArtifactError, GRAPHS, SIGNATURE_FILE, SIGNATURE_KEY, STATE_FILE, checkSignature, jsonEqual, repr,
} from "./format.mjs";
import { MalformedProtobuf, externalLocations, modelInfo } from "./onnx-proto.mjs";
import { readHeader, typedArray } from "./safetensors.mjs";

const dirname = (relative) => (relative.includes("/") ? relative.slice(0, relative.lastIndexOf("/")) : "");

function parseModel(bytes, where, parse) {
  try {
    return parse(bytes);
  } catch (e) {
    if (e instanceof MalformedProtobuf) throw new ArtifactError(`${where} is not a valid ONNX model (malformed protobuf)`);
    if (e instanceof RangeError) throw new ArtifactError(`${where} nests graphs too deeply to be checked`);
    throw e;
  }
}

/**
 * Reads and checks an artifact from `store` (nodeStore or urlStore).
 * @returns {{store, signature, models: Object<string, {relative, path, bytes, external, info}>,
 *            state: Object<string, {dtype, shape, data}>}}
 * @throws {ArtifactError} anything the format says a reader must refuse, naming the file and the problem.
 */
export async function openArtifact(store) {
  const { root } = store;
  if (!(await store.isDirectory())) {
    throw new ArtifactError(`${root} is not a directory: an aot2onnx training artifact is a directory`);
  }
  const signaturePath = store.display(SIGNATURE_FILE);
  if (!(await store.exists(SIGNATURE_FILE, `${root}: the signature file`))) {
    throw new ArtifactError(`${signaturePath} is missing: ${root} is not an aot2onnx training artifact (or is incomplete)`);
  }
  let signature;
  try {
    const text = new TextDecoder("utf-8", { fatal: true }).decode(await store.read(SIGNATURE_FILE, `${root}: the signature file`));
    signature = JSON.parse(text);
  } catch (e) {
    if (e instanceof ArtifactError) throw e;
    throw new ArtifactError(`${signaturePath} is not valid JSON: ${e.message}`);
  }
  checkSignature(signature, signaturePath);

  const models = {};
  for (const graph of GRAPHS) {
    if (signature[graph] === undefined || signature[graph] === null) continue;
    const relative = signature[graph].model;
    const what = `${signaturePath}: ${graph}.model`;
    const path = store.display(relative);
    if (!(await store.exists(relative, what))) throw new ArtifactError(`${path} is missing (the signature's ${graph} model)`);
    const bytes = await store.read(relative, what);
    const external = [];
    for (const [tensor, location] of parseModel(bytes, path, externalLocations)) {
      // Locations are relative to the model's directory, itself inside the artifact.
      const where = `${path}: the external data of tensor ${repr(tensor)}`;
      if (!(await store.exists(location, where, dirname(relative)))) {
        throw new ArtifactError(`${where} is in ${repr(location)}, which is missing`);
      }
      external.push({ location, read: () => store.read(location, where, dirname(relative)) });
    }
    models[graph] = { relative, path, bytes, external };
  }
  if (!(await store.exists(STATE_FILE, `${root}: the state file`))) {
    throw new ArtifactError(`${store.display(STATE_FILE)} is missing: the artifact has no state`);
  }

  // Every model's inputs and outputs first: a disagreement there says more than a differing copy.
  for (const [graph, model] of Object.entries(models)) {
    model.info = parseModel(model.bytes, model.path, modelInfo);
    checkModelIO(signature, graph, model);
  }
  for (const model of Object.values(models)) {
    const embedded = model.info.metadata[SIGNATURE_KEY];
    if (embedded === undefined) continue; // a tool dropped it: nothing to compare
    let same;
    try {
      same = jsonEqual(JSON.parse(embedded), signature);
    } catch {
      same = false;
    }
    if (!same) {
      throw new ArtifactError(`${model.path} carries a different signature than ${signaturePath}: the files come from different exports`);
    }
  }
  const state = readState(await store.read(STATE_FILE, `${root}: the state file`), store.display(STATE_FILE), signature);
  return { store, signature, models, state };
}

/** Refuses a model whose inputs or outputs differ from its section in names, dtypes, ranks or static sizes. */
export function checkModelIO(signature, graph, model) {
  const { path, info } = model;
  for (const direction of ["inputs", "outputs"]) {
    const noun = direction.slice(0, -1);
    const actual = new Map(info[direction].map((v) => [v.name, v]));
    const expected = new Map(signature[graph][direction].map((e) => [e.name, e]));
    for (const [name, entry] of expected) {
      if (!actual.has(name)) {
        throw new ArtifactError(`${path}: the signature lists ${noun} ${repr(name)} (${entry.role}), which the model ` +
          `does not have; the model's ${direction}: ${repr([...actual.keys()].sort())}`);
      }
    }
    for (const name of actual.keys()) {
      if (!expected.has(name)) throw new ArtifactError(`${path}: the model has ${noun} ${repr(name)}, which the signature does not list`);
    }
    for (const [name, entry] of expected) {
      const { dtype, shape } = actual.get(name);
      if (dtype !== entry.dtype) {
        throw new ArtifactError(`${path}: ${noun} ${repr(name)} is ${dtype} in the model but ${entry.dtype} in the signature`);
      }
      if (shape === null) continue;
      if (shape.length !== entry.shape.length) {
        throw new ArtifactError(`${path}: ${noun} ${repr(name)} has rank ${shape.length} in the model but ` +
          `${entry.shape.length} in the signature (${repr(entry.shape)})`);
      }
      shape.forEach((got, i) => {
        const want = entry.shape[i];
        if (typeof got === "number" && typeof want === "number" && got !== want) {
          throw new ArtifactError(`${path}: ${noun} ${repr(name)} has shape ${repr(shape)} in the model but ` +
            `${repr(entry.shape)} in the signature`);
        }
      });
    }
  }
}

/** The state tensors the signature lists, each checked (present, dtype, shape). */
export function readState(bytes, path, signature) {
  let header;
  try {
    header = readHeader(bytes);
  } catch (e) {
    throw new ArtifactError(`${path} is not a readable safetensors file: ${e.message}`);
  }
  const state = {};
  for (const entry of signature.state) {
    const tensor = header.tensors[entry.name];
    if (tensor === undefined) {
      throw new ArtifactError(`${path} has no tensor ${repr(entry.name)} (${entry.kind} in the signature)`);
    }
    if (tensor.dtype !== entry.dtype || !jsonEqual(tensor.shape, entry.shape)) {
      throw new ArtifactError(`${path}: tensor ${repr(entry.name)} is ${tensor.dtype}${repr(tensor.shape)}, the ` +
        `signature says ${entry.dtype}${repr(entry.shape)}`);
    }
    const start = header.dataStart;
    state[entry.name] = { dtype: tensor.dtype, shape: tensor.shape,
      data: typedArray(tensor.dtype, bytes.subarray(start + tensor.begin, start + tensor.end)) };
  }
  return state;
}
