// The artifact format (docs/artifact-format.md): its constants, the signature's checks, the learning-rate
// schedules. Nothing here touches a file or ONNX Runtime, so Node and a browser share it.

export const FORMAT = "aot2onnx.training/2";
// /1: the learning rate and AdamW's weight decay were constants of optimizer.onnx; /2 made them inputs and added
// the schedule and gradient clipping. A /2 reader reads /1 artifacts.
export const READABLE_FORMATS = ["aot2onnx.training/1", FORMAT];
export const SIGNATURE_FILE = "signature.json";
export const STATE_FILE = "state.safetensors";
export const SIGNATURE_KEY = "aot2onnx.signature"; // each model's metadata_props entry holding the signature
// Each model's metadata_props entry naming ONNX Runtime's rewrites that would compute a wrong result in it,
// comma-separated (aot2onnx's runtime decides, the exporter records it: aot2onnx/runtime/rewrites.py).
export const DISABLED_OPTIMIZERS_KEY = "aot2onnx.ort_disabled_optimizers";
// Each model's metadata_props entry naming its nodes ONNX Runtime computes wrongly on more than one thread
// (ScatterND with a reduction: threads adding to one row lose updates), comma-separated: with any, or without
// the entry (an artifact exported before it), the model's session runs on one thread.
export const ONE_THREAD_KEY = "aot2onnx.ort_one_thread_nodes";

/** Whether one model's session must run on one thread (its metadata). */
export function oneThread(metadata) {
  const recorded = metadata[ONE_THREAD_KEY];
  return recorded === undefined || recorded !== "";
}
// What a model exported before that entry existed is read with: every rewrite aot2onnx had turned off by then.
export const DISABLED_BEFORE_THE_KEY = "NoopElimination,ExpandElimination";

/** The rewrites to turn off for one model (its metadata), refused unless they are names. */
export function disabledOptimizers(metadata, path) {
  const recorded = metadata[DISABLED_OPTIMIZERS_KEY];
  if (recorded === undefined) return DISABLED_BEFORE_THE_KEY;
  if (recorded !== "" && !recorded.split(",").every((name) => /^[A-Za-z][A-Za-z0-9_]*$/.test(name))) {
    throw new ArtifactError(`${path}: metadata ${repr(DISABLED_OPTIMIZERS_KEY)} is ${repr(recorded)}, not a ` +
      "comma-separated list of ONNX Runtime rewrite names");
  }
  return recorded;
}
export const STEP_STATE = "optimizer:step";
export const GRAPHS = ["forward", "backward", "optimizer"];
export const DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
  "uint16", "uint32", "uint64", "bool"];

/** The artifact is missing, malformed or inconsistent; the message names the file and the problem. */
export class ArtifactError extends Error {
  constructor(message) {
    super(message);
    this.name = "ArtifactError";
  }
}

/** A value as Python's repr writes it, so that messages read as the Python readers' do. */
export function repr(value) {
  if (value === null || value === undefined) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (typeof value === "string") {
    const quote = value.includes("'") && !value.includes('"') ? '"' : "'";
    const body = value.replace(/\\/g, "\\\\").replace(/\n/g, "\\n").replace(/\t/g, "\\t");
    return quote + (quote === "'" ? body.replace(/'/g, "\\'") : body) + quote;
  }
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : formatFloat(value);
  if (typeof value === "bigint") return String(value);
  if (Array.isArray(value)) return `[${value.map(repr).join(", ")}]`;
  return `{${Object.entries(value).map(([k, v]) => `${repr(k)}: ${repr(v)}`).join(", ")}}`;
}

/** A double as Python's repr(float) writes it: the shortest digits that round-trip, in exponent form below
 * 1e-4 and from 1e16 up. The trainers print losses this way, so their lines compare as text. */
export function formatFloat(x) {
  if (Number.isNaN(x)) return "nan";
  if (!Number.isFinite(x)) return x > 0 ? "inf" : "-inf";
  if (x === 0) return Object.is(x, -0) ? "-0.0" : "0.0";
  const [mantissa, exponentText] = Math.abs(x).toExponential().split("e"); // shortest round-trip digits
  const digits = mantissa.replace(".", "");
  const exponent = Number(exponentText);
  const sign = x < 0 ? "-" : "";
  if (exponent < -4 || exponent >= 16) {
    const e = `${exponent < 0 ? "-" : "+"}${String(Math.abs(exponent)).padStart(2, "0")}`;
    return `${sign}${digits[0]}${digits.length > 1 ? "." + digits.slice(1) : ""}e${e}`;
  }
  if (exponent < 0) return `${sign}0.${"0".repeat(-exponent - 1)}${digits}`;
  const whole = digits.slice(0, exponent + 1).padEnd(exponent + 1, "0");
  const fraction = digits.slice(exponent + 1) || "0";
  return `${sign}${whole}.${fraction}`;
}

/** The learning-rate multiplier of `schedule` for the optimizer step after `step` completed ones: LambdaLR with
 * transformers' warm-up lambdas, in double precision (docs/artifact-format.md, "The optimizers"). */
export function lrFactor(schedule, step) {
  if (schedule === null || schedule === undefined || schedule.name === "constant") return 1.0;
  const { name } = schedule;
  const warmup = Math.trunc(schedule.warmup_steps);
  const total = Math.trunc(schedule.total_steps);
  if (step < warmup) return step / Math.max(1, warmup);
  const progress = (step - warmup) / Math.max(1, total - warmup);
  if (name === "linear") return Math.max(0.0, 1.0 - progress);
  if (name === "cosine") {
    const cycles = schedule.num_cycles === undefined ? 0.5 : Number(schedule.num_cycles);
    return Math.max(0.0, 0.5 * (1.0 + Math.cos(Math.PI * cycles * 2.0 * progress)));
  }
  throw new ArtifactError(`unknown learning-rate schedule ${repr(name)}`);
}

// Which roles each model's inputs and outputs may have, and what their "source" / "target" names.
const ROLES = {
  "forward.inputs": { parameter: "parameter", buffer: "buffer", user_input: "user_input" },
  "forward.outputs": { loss: null, user_output: null, buffer_update: "buffer", saved: null },
  "backward.inputs": { saved: "forward_output", grad_of_loss: null, parameter: "parameter", buffer: "buffer",
    user_input: "user_input" },
  "backward.outputs": { grad: "parameter" },
  "optimizer.inputs": { parameter: "parameter", grad: "gradient", optimizer_state: "optimizer_state",
    step: "optimizer_state", lr: null, weight_decay: null },
  "optimizer.outputs": { parameter_update: "parameter", optimizer_state_update: "optimizer_state" },
};
const STATE_KINDS = ["parameter", "buffer", "optimizer_state"];
const SCHEDULES = { constant: [], linear: ["warmup_steps", "total_steps"], cosine: ["warmup_steps", "total_steps"] };

const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const isInt = (v) => Number.isInteger(v);
const has = (object, key) => Object.prototype.hasOwnProperty.call(object, key);

/** Checks the signature's structure and that every name it refers to exists; `where` names the file. */
export function checkSignature(sig, where) {
  const fail = (message) => new ArtifactError(`${where}: ${message}`);
  if (!isObject(sig)) throw fail("the signature must be a JSON object");
  if (!READABLE_FORMATS.includes(sig.format)) {
    throw fail(`unknown format ${repr(sig.format)}; this reader understands ${READABLE_FORMATS.map(repr).join(", ")}`);
  }
  for (const [key, list] of [["state", true], ["user_inputs", true], ["forward", false], ["backward", false]]) {
    if (list ? !Array.isArray(sig[key]) : !isObject(sig[key])) {
      throw fail(`${repr(key)} must be a JSON ${list ? "array" : "object"}`);
    }
  }
  if (sig.optimizer !== undefined && sig.optimizer !== null && !isObject(sig.optimizer)) {
    throw fail("'optimizer' must be a JSON object or null");
  }
  const hyper = isObject(sig.optimizer) ? sig.optimizer.hyperparameters : undefined;
  const schedule = isObject(hyper) ? hyper.schedule : undefined;
  if (schedule !== undefined && schedule !== null) {
    const known = isObject(schedule) && typeof schedule.name === "string" && has(SCHEDULES, schedule.name);
    if (!known || !SCHEDULES[schedule.name].every((k) => isInt(schedule[k]) && schedule[k] >= 0)) {
      throw fail(`optimizer schedule ${repr(schedule)} is not one this reader knows (${repr(Object.keys(SCHEDULES).sort())})`);
    }
  }
  const dims = sig.dims === undefined ? {} : sig.dims;
  if (!isObject(dims)) throw fail("'dims' must be a JSON object");
  for (const [dim, limits] of Object.entries(dims)) {
    const ok = isObject(limits) && isInt(limits.min) && (limits.max === null || limits.max === undefined || isInt(limits.max));
    if (!ok) throw fail(`dim ${repr(dim)} needs an integer 'min' and an integer or null 'max', got ${repr(limits)}`);
  }

  const state = new Map();
  for (const entry of sig.state) {
    checkTensorEntry(entry, fail, "state", true);
    if (!STATE_KINDS.includes(entry.kind)) {
      throw fail(`state ${repr(entry.name)} has kind ${repr(entry.kind)}, not one of ${repr(STATE_KINDS)}`);
    }
    if (state.has(entry.name)) throw fail(`state ${repr(entry.name)} is listed twice`);
    state.set(entry.name, entry);
  }
  const tied = sig.tied === undefined ? [] : sig.tied;
  if (!Array.isArray(tied)) throw fail("'tied' must be a JSON array");
  for (const entry of tied) {
    if (!isObject(entry) || typeof entry.name !== "string" || !state.has(entry.state)) {
      throw fail(`tied entry ${repr(entry)} must name itself and a state entry`);
    }
    if (state.has(entry.name) || tied.filter((e) => isObject(e) && e.name === entry.name).length > 1) {
      throw fail(`tied name ${repr(entry.name)} is listed twice`);
    }
  }
  sig.user_inputs.forEach((entry, i) => {
    checkTensorEntry(entry, fail, "user_inputs", false);
    if (entry.position !== i) {
      throw fail(`user input ${repr(entry.name)} has position ${repr(entry.position)}, expected ${i}`);
    }
  });

  const entriesOf = (section, direction) => (Array.isArray(section[direction]) ? section[direction] : []);
  const forwardOutputs = new Set(entriesOf(sig.forward, "outputs").filter(isObject).map((e) => e.name));
  const gradients = new Set(entriesOf(sig.backward, "outputs").filter(isObject).map((e) => e.target));
  const kindIs = (kind) => (v) => typeof v === "string" && state.has(v) && state.get(v).kind === kind;
  const referents = {
    parameter: kindIs("parameter"),
    buffer: kindIs("buffer"),
    optimizer_state: kindIs("optimizer_state"),
    user_input: (v) => isInt(v) && v >= 0 && v < sig.user_inputs.length,
    forward_output: (v) => forwardOutputs.has(v),
    gradient: (v) => gradients.has(v),
  };
  for (const graph of GRAPHS) {
    const section = sig[graph];
    if (section === undefined || section === null) continue;
    if (typeof section.model !== "string") throw fail(`${graph}.model must be a file name`);
    for (const direction of ["inputs", "outputs"]) {
      const entries = section[direction];
      if (!Array.isArray(entries)) throw fail(`${graph}.${direction} must be a JSON array`);
      const roles = ROLES[`${graph}.${direction}`];
      const names = new Set();
      for (const entry of entries) {
        checkTensorEntry(entry, fail, `${graph}.${direction}`, false);
        if (names.has(entry.name)) throw fail(`${graph}.${direction} lists ${repr(entry.name)} twice`);
        names.add(entry.name);
        const role = entry.role;
        if (typeof role !== "string" || !has(roles, role)) {
          throw fail(`${graph}.${direction} ${repr(entry.name)} has role ${repr(role)}, not one of ${repr(Object.keys(roles).sort())}`);
        }
        const refersTo = roles[role];
        if (refersTo !== null) {
          const key = direction === "inputs" ? "source" : "target";
          if (!referents[refersTo](entry[key])) {
            throw fail(`${graph}.${direction} ${repr(entry.name)} (${role}) has ${key} ${repr(entry[key])}, which names no ${refersTo.replace("_", " ")}`);
          }
        }
      }
    }
  }
  const losses = sig.forward.outputs.filter((e) => e.role === "loss");
  if (losses.length !== 1) {
    throw fail(`the forward model must have exactly one loss output, the signature lists ${losses.length}`);
  }
}

function checkTensorEntry(entry, fail, where, isStatic) {
  if (!isObject(entry) || typeof entry.name !== "string" || !entry.name) {
    throw fail(`every entry of ${where} needs a non-empty 'name', got ${repr(entry)}`);
  }
  if (!DTYPES.includes(entry.dtype)) {
    throw fail(`${where} ${repr(entry.name)} has dtype ${repr(entry.dtype)}, not one of ${repr(DTYPES)}`);
  }
  const dimOk = isStatic ? (d) => isInt(d) && d >= 0 : (d) => isInt(d) || typeof d === "string";
  if (!Array.isArray(entry.shape) || !entry.shape.every(dimOk)) {
    throw fail(`${where} ${repr(entry.name)} has shape ${repr(entry.shape)}; expected a list of ${isStatic ? "sizes" : "sizes and dim names"}`);
  }
}

/** Deep equality of two parsed JSON values (object keys in any order). */
export function jsonEqual(a, b) {
  if (a === b) return true;
  if (Array.isArray(a)) return Array.isArray(b) && a.length === b.length && a.every((v, i) => jsonEqual(v, b[i]));
  if (isObject(a) && isObject(b)) {
    const keys = Object.keys(a);
    return keys.length === Object.keys(b).length && keys.every((k) => has(b, k) && jsonEqual(a[k], b[k]));
  }
  return false;
}
