// numpy's .npy and .npz files, read without pickle (as np.load(allow_pickle=False)): an .npy file is the magic
// "\x93NUMPY", a version, a header (a Python dict literal: descr, fortran_order, shape) and the raw elements; an
// .npz file is a zip archive of .npy files (np.savez stores them, np.savez_compressed deflates them).

import { unzipSync } from "fflate";

import { ARRAYS, numel, typedArray } from "./safetensors.mjs";

export class NpyError extends Error {}

const DESCRS = { f2: "float16", f4: "float32", f8: "float64", i1: "int8", i2: "int16", i4: "int32", i8: "int64",
  u1: "uint8", u2: "uint16", u4: "uint32", u8: "uint64", b1: "bool" };

function parseHeader(text, where) {
  const descr = /'descr'\s*:\s*'([^']*)'/.exec(text);
  const order = /'fortran_order'\s*:\s*(True|False)/.exec(text);
  const shape = /'shape'\s*:\s*\(([^)]*)\)/.exec(text);
  if (!descr || !order || !shape) throw new NpyError(`${where}: cannot read the .npy header ${JSON.stringify(text)}`);
  const dims = shape[1].split(",").map((s) => s.trim()).filter((s) => s !== "");
  if (!dims.every((d) => /^\d+$/.test(d))) throw new NpyError(`${where}: the .npy shape (${shape[1]}) is not a list of sizes`);
  return { descr: descr[1], fortran: order[1] === "True", shape: dims.map(Number) };
}

/** One .npy file as {dtype, shape, data} (C order). */
export function readNpy(bytes, where = "array") {
  const magic = [0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59]; // \x93NUMPY
  if (bytes.length < 10 || !magic.every((b, i) => bytes[i] === b)) throw new NpyError(`${where} is not an .npy file`);
  const major = bytes[6];
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const [length, start] = major === 1 ? [view.getUint16(8, true), 10] : [view.getUint32(8, true), 12];
  if (major < 1 || major > 3 || start + length > bytes.length) throw new NpyError(`${where}: unknown .npy version ${major}`);
  const header = parseHeader(new TextDecoder(major === 3 ? "utf-8" : "latin1").decode(bytes.subarray(start, start + length)), where);
  const { descr, shape } = header;
  if (descr.includes("O")) {
    throw new NpyError(`${where} holds an object array (dtype ${JSON.stringify(descr)}), which only pickle can read; ` +
      "refused, as numpy refuses it with allow_pickle=False");
  }
  const endian = descr[0];
  const dtype = DESCRS[descr.slice(1)];
  if (!"<>|=".includes(endian) || dtype === undefined) {
    throw new NpyError(`${where} has dtype ${JSON.stringify(descr)}, which this reader does not know`);
  }
  const size = ARRAYS[dtype].BYTES_PER_ELEMENT;
  const begin = start + length;
  const count = numel(shape);
  if (begin + count * size > bytes.length) throw new NpyError(`${where} is shorter than its shape ${JSON.stringify(shape)}`);
  const raw = new Uint8Array(bytes.subarray(begin, begin + count * size));
  if (endian === ">" && size > 1) {
    for (let i = 0; i < raw.length; i += size) raw.subarray(i, i + size).reverse();
  }
  let data = typedArray(dtype, raw);
  if (header.fortran && shape.length > 1) data = fortranToC(data, shape);
  return { dtype, shape, data };
}

function fortranToC(data, shape) {
  const out = new data.constructor(data.length);
  const index = new Array(shape.length).fill(0);
  for (let c = 0; c < data.length; c++) {
    let f = 0;
    for (let d = shape.length - 1; d >= 0; d--) f = f * shape[d] + index[d];
    out[c] = data[f];
    for (let d = shape.length - 1; d >= 0; d--) { // the next C-order index
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

/** Every array of an .npz file, by name (the member's name less ".npy"), in the archive's order. */
export function readNpz(bytes, where = "npz") {
  let members;
  try {
    members = unzipSync(bytes);
  } catch (e) {
    throw new NpyError(`${where} is not an .npz (zip) file: ${e.message}`);
  }
  const arrays = {};
  for (const [name, content] of Object.entries(members)) {
    if (!name.endsWith(".npy")) continue;
    arrays[name.slice(0, -4)] = readNpy(content, `${where}: ${name}`);
  }
  return arrays;
}
