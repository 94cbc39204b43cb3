#!/usr/bin/env node
// node js/cli.mjs ARTIFACT_DIR --data batches.npz --steps N --out state.safetensors [--threads T]
//
// The command line of aot2onnx/artifact/edge.py, with the same arguments and meaning: --data holds one array per
// user input (named as in signature.json's user_inputs, or arr_<position>), each [num_batches, *input shape];
// step i (from 0) uses batch i mod num_batches; each step prints "step <i> loss <loss>" (the loss as Python's
// repr writes the float), and the final state goes to --out. Exit status 1 for a refused artifact, data file or
// --out, 2 for bad arguments.

import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

import { formatFloat } from "./src/format.mjs";
import { loadNpz, openTrainer } from "./src/node.mjs";
import { batchAt, orderBatches } from "./src/trainer.mjs";

const PROG = "node js/cli.mjs";
const USAGE = `usage: ${PROG} [-h] --data batches.npz --steps N --out state.safetensors [--threads THREADS] ARTIFACT_DIR`;
const HELP = `${USAGE}

Train an aot2onnx training artifact with ONNX Runtime (onnxruntime-node); prints the loss per step.

positional arguments:
  ARTIFACT_DIR

options:
  -h, --help            show this help message and exit
  --data batches.npz    one array per model input, named as in signature.json's user_inputs (or arr_0, arr_1, ...),
                        each of shape [num_batches, *input shape]; step i uses batch i mod num_batches
  --steps N
  --out state.safetensors
                        where to write the final state
  --threads THREADS     ONNX Runtime intra-op threads (0: its default)`;

class UsageError extends Error {}

export function parseArgs(argv) {
  const options = { data: null, steps: null, out: null, threads: "0" };
  const positional = [];
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "-h" || arg === "--help") return { help: true };
    const match = /^--(data|steps|out|threads)(?:=(.*))?$/.exec(arg);
    if (match) {
      let value = match[2];
      if (value === undefined) {
        if (i + 1 >= argv.length || argv[i + 1].startsWith("--")) throw new UsageError(`argument --${match[1]}: expected one argument`);
        value = argv[++i];
      }
      options[match[1]] = value;
    } else if (arg.startsWith("-") && arg !== "-") {
      throw new UsageError(`unrecognized arguments: ${arg}`);
    } else {
      positional.push(arg);
    }
  }
  if (positional.length > 1) throw new UsageError(`unrecognized arguments: ${positional.slice(1).join(" ")}`);
  const missing = [...(positional.length ? [] : ["ARTIFACT_DIR"]),
    ...["data", "steps", "out"].filter((k) => options[k] === null).map((k) => `--${k}`)];
  if (missing.length) throw new UsageError(`the following arguments are required: ${missing.join(", ")}`);
  for (const key of ["steps", "threads"]) {
    if (!/^[+-]?\d+$/.test(options[key].trim())) throw new UsageError(`argument --${key}: invalid int value: '${options[key]}'`);
  }
  const steps = Number(options.steps);
  const threads = Number(options.threads);
  if (steps < 1) throw new UsageError(`--steps must be at least 1, got ${steps}`);
  if (threads < 0) throw new UsageError(`--threads must be 0 (ONNX Runtime's default) or more, got ${threads}`);
  return { artifact: positional[0], data: options.data, steps, out: options.out, threads };
}

/** Throws unless a file can be written at `out` (a probe file is created and removed): refused before training. */
function checkWritable(out) {
  const target = path.resolve(out);
  const isDir = (p) => { try { return fs.statSync(p).isDirectory(); } catch { return false; } };
  if (isDir(target)) throw new Error(`--out '${out}' is a directory; name the state file to write`);
  const directory = path.dirname(target);
  if (!isDir(directory)) throw new Error(`--out '${out}': the directory ${directory} does not exist`);
  const probe = path.join(directory, `.aot2onnx-probe-${process.pid}-${Math.random().toString(36).slice(2)}`);
  try {
    fs.closeSync(fs.openSync(probe, "wx"));
  } catch (e) {
    throw new Error(`--out '${out}': cannot write in ${directory}: ${e.code}`);
  }
  fs.unlinkSync(probe);
}

export async function main(argv) {
  let args;
  try {
    args = parseArgs(argv);
  } catch (e) {
    if (!(e instanceof UsageError)) throw e;
    process.stderr.write(`${USAGE}\n${PROG}: error: ${e.message}\n`);
    return 2;
  }
  if (args.help) {
    process.stdout.write(`${HELP}\n`);
    return 0;
  }
  let trainer;
  try {
    checkWritable(args.out);
    trainer = await openTrainer(args.artifact, { threads: args.threads });
    const batches = orderBatches(loadNpz(args.data), trainer.signature.user_inputs, args.data);
    const count = batches[0].shape[0];
    for (let step = 0; step < args.steps; step++) {
      const loss = await trainer.step(...batchAt(batches, step % count));
      process.stdout.write(`step ${step + 1} loss ${formatFloat(loss)}\n`);
      if (!Number.isFinite(loss)) process.stderr.write(`the loss is ${formatFloat(loss)} at step ${step + 1}\n`);
    }
    fs.writeFileSync(args.out, trainer.saveBytes());
  } catch (e) {
    if (!(e instanceof Error)) throw e;
    process.stderr.write(`error: ${e.message}\n`);
    return 1;
  } finally {
    if (trainer) await trainer.release();
  }
  process.stderr.write(`wrote ${args.out}\n`);
  return 0;
}

if (import.meta.url === pathToFileURL(fs.realpathSync(process.argv[1])).href) {
  process.exitCode = await main(process.argv.slice(2));
}
