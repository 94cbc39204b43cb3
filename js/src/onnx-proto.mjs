// What a reader needs from an ONNX model, read from the protobuf wire format before ONNX Runtime sees the file:
// every external-data location (so a hostile model never makes ONNX Runtime read outside the artifact), the
// graph's inputs and outputs (names, dtypes, shapes) and the model's metadata_props. Field numbers are
// onnx.proto's; the external-data walk follows the same messages as aot2onnx/artifact/edge.py's.

export class MalformedProtobuf extends Error {}

// Each path leads from ModelProto to every TensorProto in it.
const MESSAGES = {
  model: { 7: "graph", 20: "training_info", 25: "function" },
  training_info: { 1: "graph", 2: "graph" },
  graph: { 1: "node", 5: "tensor", 15: "sparse_tensor" },
  function: { 7: "node", 11: "attribute" }, // 11: the default values of the function's attributes
  node: { 5: "attribute" },
  attribute: { 5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse_tensor", 23: "sparse_tensor" },
  sparse_tensor: { 1: "tensor", 2: "tensor" },
};
const TENSOR_NAME = 8;
const TENSOR_EXTERNAL_DATA = 13;
const MAX_DEPTH = 200; // a model nesting graphs deeper than this is refused rather than walked

// TensorProto.DataType -> the signature's dtype names.
const ELEM_TYPES = { 1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 8: "string",
  9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 14: "complex64", 15: "complex128", 16: "bfloat16" };

const decoder = new TextDecoder("utf-8"); // replaces invalid bytes, as Python's decode("utf-8", "replace")

function varint(buf, pos) {
  let result = 0;
  let scale = 1;
  for (let shift = 0; ; shift += 7) {
    if (pos >= buf.length || shift > 63) throw new MalformedProtobuf();
    const byte = buf[pos++];
    result += (byte & 0x7f) * scale; // exact up to 2^53: sizes and enums; beyond that only skipped
    scale *= 128;
    if (!(byte & 0x80)) return [result, pos];
  }
}

/** [field number, bytes of a length-delimited field or null, varint value or null] for each field of a message. */
function* fields(buf) {
  let pos = 0;
  while (pos < buf.length) {
    let key;
    [key, pos] = varint(buf, pos);
    const wire = key % 8;
    const number = Math.floor(key / 8);
    let bytes = null;
    let value = null;
    if (wire === 0) {
      [value, pos] = varint(buf, pos);
    } else if (wire === 1 || wire === 5) {
      pos += wire === 1 ? 8 : 4;
    } else if (wire === 2) {
      let length;
      [length, pos] = varint(buf, pos);
      bytes = buf.subarray(pos, pos + length);
      pos += length;
    } else {
      throw new MalformedProtobuf();
    }
    if (pos > buf.length) throw new MalformedProtobuf();
    yield [number, bytes, value];
  }
}

function stringEntry(buf) {
  let key = null;
  let value = "";
  for (const [number, bytes] of fields(buf)) {
    if (bytes !== null && number === 1) key = decoder.decode(bytes);
    if (bytes !== null && number === 2) value = decoder.decode(bytes);
  }
  return [key, value];
}

/** [tensor name, location] of every tensor of the model stored as external data. */
export function externalLocations(buf) {
  const found = [];
  const walk = (bytes, message, depth) => {
    if (depth > MAX_DEPTH) throw new RangeError("nesting");
    if (message === "tensor") {
      let name = "";
      let location = null;
      for (const [number, value] of fields(bytes)) {
        if (value === null) continue;
        if (number === TENSOR_NAME) name = decoder.decode(value);
        else if (number === TENSOR_EXTERNAL_DATA) {
          const [key, text] = stringEntry(value);
          if (key === "location") location = text;
        }
      }
      if (location !== null) found.push([name, location]);
      return;
    }
    const children = MESSAGES[message];
    for (const [number, value] of fields(bytes)) {
      if (value !== null && Object.prototype.hasOwnProperty.call(children, number)) walk(value, children[number], depth + 1);
    }
  };
  walk(buf, "model", 0);
  return found;
}

function valueInfo(buf) {
  let name = "";
  let dtype = "a non-tensor type";
  let shape = null; // null: the model declares no shape
  for (const [number, bytes] of fields(buf)) {
    if (bytes === null) continue;
    if (number === 1) name = decoder.decode(bytes);
    if (number !== 2) continue;
    for (const [typeField, typeBytes] of fields(bytes)) { // TypeProto
      if (typeField !== 1 || typeBytes === null) continue; // 1: tensor_type
      dtype = "tensor(undefined)";
      for (const [tensorField, tensorBytes, tensorValue] of fields(typeBytes)) {
        if (tensorField === 1 && tensorValue !== null) dtype = ELEM_TYPES[tensorValue] || `tensor(${tensorValue})`;
        if (tensorField === 2 && tensorBytes !== null) {
          shape = [];
          for (const [shapeField, dimBytes] of fields(tensorBytes)) {
            if (shapeField !== 1 || dimBytes === null) continue;
            let dim = null; // neither a size nor a name: unknown
            for (const [dimField, nameBytes, size] of fields(dimBytes)) {
              if (dimField === 1 && size !== null) dim = size;
              if (dimField === 2 && nameBytes !== null) dim = decoder.decode(nameBytes);
            }
            shape.push(dim);
          }
        }
      }
    }
  }
  return { name, dtype, shape };
}

/** The graph's inputs (less initializers, which ONNX Runtime does not list as inputs) and outputs, and the
 * model's metadata_props. */
export function modelInfo(buf) {
  const metadata = {};
  const inputs = [];
  const outputs = [];
  const initializers = new Set();
  for (const [number, bytes] of fields(buf)) {
    if (bytes === null) continue;
    if (number === 14) { // metadata_props
      const [key, value] = stringEntry(bytes);
      if (key !== null) metadata[key] = value;
    } else if (number === 7) { // graph
      for (const [graphField, graphBytes] of fields(bytes)) {
        if (graphBytes === null) continue;
        if (graphField === 11) inputs.push(valueInfo(graphBytes));
        if (graphField === 12) outputs.push(valueInfo(graphBytes));
        if (graphField === 5) {
          for (const [tensorField, nameBytes] of fields(graphBytes)) {
            if (tensorField === TENSOR_NAME && nameBytes !== null) initializers.add(decoder.decode(nameBytes));
          }
        }
      }
    }
  }
  return { metadata, inputs: inputs.filter((i) => !initializers.has(i.name)), outputs };
}
