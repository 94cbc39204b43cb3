// safetensors: an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape, data_offsets}},
// and "__metadata__": {string: string}), then the tensors' bytes, little-endian, C order. A tensor here is
// {dtype, shape, data}: the signature's dtype name, a list of sizes, and a typed array of the elements
// (bool as Uint8Array, float16 and bfloat16 as Uint16Array, 64-bit integers as BigInt64Array / BigUint64Array).

export const CODES = { F32: "float32", F64: "float64", F16: "float16", BF16: "bfloat16", I64: "int64", I32: "int32",
  I16: "int16", I8: "int8", U8: "uint8", U16: "uint16", U32: "uint32", U64: "uint64", BOOL: "bool" };
const NAMES = Object.fromEntries(Object.entries(CODES).map(([code, name]) => [name, code]));
export const ARRAYS = { float32: Float32Array, float64: Float64Array, float16: Uint16Array, bfloat16: Uint16Array,
  int64: BigInt64Array, int32: Int32Array, int16: Int16Array, int8: Int8Array, uint8: Uint8Array,
  uint16: Uint16Array, uint32: Uint32Array, uint64: BigUint64Array, bool: Uint8Array };
const MAX_HEADER = 100_000_000; // safetensors' own limit

if (new Uint8Array(Uint16Array.of(1).buffer)[0] !== 1) {
  throw new Error("aot2onnx-edge reads and writes little-endian data in place; this machine is big-endian");
}

export class SafetensorsError extends Error {}

export const numel = (shape) => shape.reduce((a, b) => a * b, 1);

/** A typed array of `dtype` holding a copy of `bytes` (copied: the offsets need not be aligned). */
export function typedArray(dtype, bytes) {
  const Array_ = ARRAYS[dtype];
  const copy = new Uint8Array(bytes.length);
  copy.set(bytes);
  return new Array_(copy.buffer, 0, bytes.length / Array_.BYTES_PER_ELEMENT);
}

/** The header of a safetensors file: {tensors: {name: {dtype, shape, begin, end}}, metadata}, checked as the
 * safetensors library checks it (sizes, offsets that tile the data exactly). */
export function readHeader(bytes) {
  if (bytes.length < 8) throw new SafetensorsError("the file is shorter than its 8-byte header length");
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const length = view.getBigUint64(0, true);
  if (length > BigInt(MAX_HEADER)) throw new SafetensorsError(`the header length ${length} is too large`);
  const n = Number(length);
  if (8 + n > bytes.length) throw new SafetensorsError(`the header length ${n} runs past the end of the file`);
  let header;
  try {
    header = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(bytes.subarray(8, 8 + n)));
  } catch (e) {
    throw new SafetensorsError(`the header is not JSON: ${e.message}`);
  }
  if (header === null || typeof header !== "object" || Array.isArray(header)) {
    throw new SafetensorsError("the header is not a JSON object");
  }
  const dataLength = bytes.length - 8 - n;
  const tensors = {};
  let metadata = null;
  const spans = [];
  for (const [name, info] of Object.entries(header)) {
    if (name === "__metadata__") {
      metadata = info;
      continue;
    }
    const dtype = info && CODES[info.dtype];
    const shape = info && info.shape;
    const offsets = info && info.data_offsets;
    if (!dtype || !Array.isArray(shape) || !shape.every((d) => Number.isInteger(d) && d >= 0) ||
        !Array.isArray(offsets) || offsets.length !== 2 || !offsets.every((o) => Number.isInteger(o) && o >= 0)) {
      throw new SafetensorsError(`tensor ${JSON.stringify(name)} has a malformed header entry`);
    }
    const [begin, end] = offsets;
    if (end < begin || end > dataLength || end - begin !== numel(shape) * ARRAYS[dtype].BYTES_PER_ELEMENT) {
      throw new SafetensorsError(`tensor ${JSON.stringify(name)} has offsets ${begin}..${end} that do not fit its ` +
        `dtype and shape or the file`);
    }
    tensors[name] = { dtype, shape, begin, end };
    spans.push([begin, end]);
  }
  spans.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
  let at = 0;
  for (const [begin, end] of spans) {
    if (begin !== at) throw new SafetensorsError("the tensors' offsets overlap or leave gaps");
    at = end;
  }
  if (at !== dataLength) throw new SafetensorsError("the data section is longer than its tensors");
  return { tensors, metadata, dataStart: 8 + n };
}

/** Every tensor of a safetensors file: {name: {dtype, shape, data}}. */
export function readSafetensors(bytes) {
  const { tensors, metadata, dataStart } = readHeader(bytes);
  const out = {};
  for (const [name, t] of Object.entries(tensors)) {
    out[name] = { dtype: t.dtype, shape: t.shape, data: typedArray(t.dtype, bytes.subarray(dataStart + t.begin, dataStart + t.end)) };
  }
  return { tensors: out, metadata };
}

/** The bytes of a safetensors file holding `tensors` ({name: {dtype, shape, data}}) and `metadata`. As the
 * safetensors library does: the largest dtypes first, then by name; the header padded with spaces to 8 bytes. */
export function writeSafetensors(tensors, metadata = null) {
  const names = Object.keys(tensors).sort((a, b) => {
    const size = (n) => ARRAYS[tensors[n].dtype].BYTES_PER_ELEMENT;
    return size(b) - size(a) || (a < b ? -1 : a > b ? 1 : 0);
  });
  const header = {};
  if (metadata !== null) header.__metadata__ = metadata;
  let offset = 0;
  for (const name of names) {
    const { dtype, shape, data } = tensors[name];
    if (!NAMES[dtype]) throw new SafetensorsError(`tensor ${JSON.stringify(name)} has dtype ${dtype}, which safetensors cannot hold`);
    if (data.length !== numel(shape)) {
      throw new SafetensorsError(`tensor ${JSON.stringify(name)} has ${data.length} elements for shape [${shape}]`);
    }
    header[name] = { dtype: NAMES[dtype], shape, data_offsets: [offset, offset + data.byteLength] };
    offset += data.byteLength;
  }
  let json = new TextEncoder().encode(JSON.stringify(header));
  const padded = Math.ceil(json.length / 8) * 8;
  const text = new Uint8Array(padded).fill(0x20);
  text.set(json);
  json = text;
  const out = new Uint8Array(8 + padded + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(padded), true);
  out.set(json, 8);
  let at = 8 + padded;
  for (const name of names) {
    const { data } = tensors[name];
    out.set(new Uint8Array(data.buffer, data.byteOffset, data.byteLength), at);
    at += data.byteLength;
  }
  return out;
}
