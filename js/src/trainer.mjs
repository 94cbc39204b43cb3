// The training step of docs/artifact-format.md, with ONNX Runtime injected: onnxruntime-node in Node,
// onnxruntime-web in a browser. The same step as aot2onnx/artifact/edge.py's Trainer: forward, backward and
// optimizer.onnx run in turn, the learning rate scheduled from the artifact's step counter, the state updated
// after all three.

import { openArtifact } from "./artifact.mjs";
import { ArtifactError, DISABLED_BEFORE_THE_KEY, FORMAT, STEP_STATE, disabledOptimizers, lrFactor, oneThread, repr } from "./format.mjs";
import { ARRAYS, numel, writeSafetensors } from "./safetensors.mjs";

// ONNX Runtime for JavaScript has no bfloat16 tensors.
const ORT_DTYPES = new Set(["float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "uint16",
  "uint32", "uint64", "bool"]);

/** Session options as edge.py sets them: no spinning threads between runs, and the rewrites the model names
 * (its metadata, disabledOptimizers) turned off. */
export function sessionOptions({ threads = 0, executionProviders, disabled = DISABLED_BEFORE_THE_KEY } = {}) {
  const options = {
    graphOptimizationLevel: "all",
    extra: {
      session: { intra_op: { allow_spinning: "0" } },
      optimization: { disable_specified_optimizers: disabled },
    },
  };
  if (threads > 0) options.intraOpNumThreads = threads;
  if (executionProviders) options.executionProviders = executionProviders;
  return options;
}

export class Trainer {
  /**
   * Opens and checks the artifact in `store`, then loads its three models into ONNX Runtime.
   * @param store nodeStore(dir) or urlStore(url)
   * @param ort the onnxruntime-node or onnxruntime-web module
   * @param options {threads, executionProviders}
   */
  static async open(store, ort, options = {}) {
    const artifact = await openArtifact(store);
    if (!artifact.models.optimizer) {
      throw new ArtifactError(`${store.root} was exported without an optimizer; export it with ` +
        "optimizer=aot2onnx.optim.SGD(...) or AdamW(...) to train it here");
    }
    for (const entry of artifact.signature.state) {
      if (!ORT_DTYPES.has(entry.dtype)) {
        throw new ArtifactError(`${store.root}: state ${repr(entry.name)} is ${entry.dtype}, which ONNX Runtime for ` +
          "JavaScript cannot hold; train this artifact with the Python reader (edge.py)");
      }
    }
    const sessions = {};
    for (const [graph, model] of Object.entries(artifact.models)) {
      const config = sessionOptions({ ...options, disabled: disabledOptimizers(model.info.metadata, model.path),
        ...(oneThread(model.info.metadata) ? { threads: 1 } : {}) });
      if (model.external.length) {
        config.externalData = await Promise.all(model.external.map(async (e) => ({ path: e.location, data: await e.read() })));
      }
      try {
        sessions[graph] = await ort.InferenceSession.create(await store.modelSource(model.relative, graph), config);
      } catch (e) {
        throw new ArtifactError(`${model.path}: ONNX Runtime cannot load it: ${e.message}`);
      }
    }
    return new Trainer(artifact, ort, sessions);
  }

  constructor(artifact, ort, sessions) {
    this.artifact = artifact;
    this.signature = artifact.signature;
    this.ort = ort;
    this.sessions = sessions;
    this.state = artifact.state;
    this.steps = 0;
    this.loss = this.signature.forward.outputs.find((e) => e.role === "loss").name;
  }

  /** Optimizer steps since export: the artifact's step counter where it keeps one, else this trainer's count. */
  get completedSteps() {
    const step = this.state[STEP_STATE];
    return step === undefined ? this.steps : Number(step.data[0]);
  }

  /** The learning rate ("lr", scheduled) or weight decay ("weight_decay") the next step uses. */
  hyperparameter(name) {
    const hyper = this.signature.optimizer.hyperparameters;
    if (name === "lr") return hyper.lr * lrFactor(hyper.schedule, this.completedSteps);
    return hyper[name];
  }

  checkInputs(inputs) {
    const specs = this.signature.user_inputs;
    if (inputs.length !== specs.length) {
      throw new Error(`step() takes ${specs.length} inputs (${specs.map((u) => u.name).join(", ")}), got ${inputs.length}`);
    }
    const bound = new Map();
    const dims = this.signature.dims || {};
    return inputs.map((array, i) => {
      const spec = specs[i];
      if (array.dtype !== spec.dtype) throw new Error(`input ${repr(spec.name)} must be ${spec.dtype}, got ${array.dtype}`);
      const wrongShape = () => new Error(`input ${repr(spec.name)} must have shape ${repr(spec.shape)}, got ${repr(array.shape)}`);
      if (array.shape.length !== spec.shape.length) throw wrongShape();
      array.shape.forEach((size, d) => {
        const dim = spec.shape[d];
        if (typeof dim === "number" && size !== dim) throw wrongShape();
        if (typeof dim === "string") {
          if (!bound.has(dim)) bound.set(dim, size);
          if (bound.get(dim) !== size) throw new Error(`inputs disagree on dim ${repr(dim)}: ${bound.get(dim)} and ${size}`);
          const limits = dims[dim] || {};
          const min = limits.min === undefined ? 0 : limits.min;
          if (size < min || (limits.max !== undefined && limits.max !== null && size > limits.max)) {
            throw new Error(`input ${repr(spec.name)}: dim ${repr(dim)} is ${size}, outside the exported range ` +
              `[${repr(limits.min)}, ${repr(limits.max)}]`);
          }
        }
      });
      return array;
    });
  }

  async run(graph, feeds) {
    const entries = this.signature[graph].outputs;
    const results = await this.sessions[graph].run(feeds, entries.map((e) => e.name));
    const out = {};
    for (const e of entries) {
      const t = results[e.name];
      out[e.name] = { dtype: t.type, shape: Array.from(t.dims), data: t.data };
    }
    return out;
  }

  /** One training step on one batch (arrays {dtype, shape, data}, one per user input); resolves to the loss,
   * computed before the update. */
  async step(...inputs) {
    inputs = this.checkInputs(inputs);
    const { ort, state, signature } = this;
    const tensor = (a) => new ort.Tensor(a.dtype, a.data, a.shape);
    const feed = (entry, forward, grads) => {
      const { role, source } = entry;
      switch (role) {
        case "parameter": case "buffer": case "optimizer_state": case "step": return tensor(state[source]);
        case "user_input": return tensor(inputs[source]);
        case "saved": return tensor(forward[source]);
        case "grad_of_loss": return tensor(ones(entry.dtype, entry.shape));
        case "grad": return tensor(grads[source]);
        case "lr": case "weight_decay": return new ort.Tensor("float64", Float64Array.of(this.hyperparameter(role)), []);
        default: throw new Error(`unknown role ${role}`); // checkSignature admits no other role
      }
    };
    const feedsOf = (graph, ...context) => Object.fromEntries(signature[graph].inputs.map((e) => [e.name, feed(e, ...context)]));
    const forward = await this.run("forward", feedsOf("forward"));
    const backward = await this.run("backward", feedsOf("backward", forward));
    const grads = Object.fromEntries(signature.backward.outputs.map((e) => [e.target, backward[e.name]]));
    const updates = await this.run("optimizer", feedsOf("optimizer", undefined, grads));
    // State changes last: the backward read the buffers' values from before the forward's updates.
    for (const e of signature.forward.outputs) if (e.role === "buffer_update") state[e.target] = forward[e.name];
    for (const e of signature.optimizer.outputs) state[e.target] = updates[e.name];
    this.steps += 1;
    return Number(forward[this.loss].data[0]);
  }

  /** The state (parameters, buffers, optimizer state) as the bytes of a state.safetensors file. */
  saveBytes() {
    return writeSafetensors(this.state, { format: FORMAT });
  }

  async release() {
    await Promise.all(Object.values(this.sessions).map((s) => s.release()));
  }
}

function ones(dtype, shape) {
  const data = new ARRAYS[dtype](numel(shape));
  const one = { int64: 1n, uint64: 1n, float16: 0x3c00, bfloat16: 0x3f80 }[dtype];
  return { dtype, shape, data: data.fill(one === undefined ? 1 : one) };
}

/** Batch `index` of each array of `batches` (arrays with a leading batch-index axis), as views. */
export function batchAt(batches, index) {
  return batches.map((b) => {
    const shape = b.shape.slice(1);
    const size = numel(shape);
    return { dtype: b.dtype, shape, data: b.data.subarray(index * size, (index + 1) * size) };
  });
}

/** The arrays of a --data file in the order of the signature's user inputs: each named after its input or
 * arr_<position>, all with the same leading (batch index) axis. */
export function orderBatches(arrays, userInputs, where) {
  const ordered = userInputs.map((spec) => {
    for (const key of [spec.name, `arr_${spec.position}`]) if (arrays[key] !== undefined) return arrays[key];
    throw new Error(`${where} has no array ${repr(spec.name)} (or arr_${spec.position}); it holds ${repr(Object.keys(arrays).sort())}`);
  });
  const counts = new Set(ordered.map((a) => (a.shape.length ? a.shape[0] : null)));
  if (counts.size !== 1 || counts.has(null)) {
    throw new Error(`${where}: every array needs the same leading (batch index) axis, got shapes ${repr(ordered.map((a) => a.shape))}`);
  }
  return ordered;
}
