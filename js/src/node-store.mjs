// An artifact directory on disk (Node). Every file read passes `inside`: a symbolic link inside the directory
// must not make the reader open a file elsewhere, as with the Python readers.

import fs from "node:fs";
import path from "node:path";

import { ArtifactError, repr } from "./format.mjs";

/** `p` resolved as far as it exists (symbolic links followed), the rest appended: Python's Path.resolve(). */
function resolveLoose(p) {
  const absolute = path.resolve(p);
  const missing = [];
  let at = absolute;
  for (;;) {
    try {
      return path.join(fs.realpathSync(at), ...missing.reverse());
    } catch (e) {
      if (e.code !== "ENOENT" && e.code !== "ENOTDIR") throw e;
      const parent = path.dirname(at);
      if (parent === at) return absolute;
      missing.push(path.basename(at));
      at = parent;
    }
  }
}

/** Refuses a relative file name that is empty, absolute, has a ".." part, or resolves outside `base`. */
export function checkRelative(relative, what, root) {
  if (typeof relative !== "string" || !relative) {
    throw new ArtifactError(`${what} must be a file name inside the artifact directory, got ${repr(relative)}`);
  }
  const parts = relative.split(/[\\/]/);
  if (relative.startsWith("/") || relative.startsWith("\\") || /^[A-Za-z]:/.test(relative) || parts.includes("..")) {
    throw new ArtifactError(`${what} is ${repr(relative)}, which points outside the artifact directory ${root}`);
  }
}

export function nodeStore(directory) {
  const root = String(directory).replace(/(?<=.)[\\/]+$/, "");
  const join = (base, relative) => (base ? path.join(root, base, relative) : path.join(root, relative));
  return {
    root,
    display: (relative) => join("", relative),
    async isDirectory() {
      try {
        return fs.statSync(root).isDirectory();
      } catch {
        return false;
      }
    },
    /** The file's path after the checks; `base` is a directory relative to the root (a model's, for its data). */
    inside(relative, what, base = "") {
      const baseDir = base ? path.join(root, base) : root;
      checkRelative(relative, what, baseDir);
      const file = join(base, relative);
      const resolved = resolveLoose(file);
      const baseResolved = resolveLoose(baseDir);
      if (resolved !== baseResolved && !resolved.startsWith(baseResolved + path.sep)) {
        throw new ArtifactError(`${what} is ${repr(relative)}, which resolves to ${resolved}, outside the artifact directory ${baseResolved}`);
      }
      return file;
    },
    async exists(relative, what, base = "") {
      const file = this.inside(relative, what, base);
      try {
        return fs.statSync(file).isFile();
      } catch {
        return false;
      }
    },
    async read(relative, what, base = "") {
      const bytes = fs.readFileSync(this.inside(relative, what, base));
      return new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    },
    /** What ONNX Runtime opens: the path (it finds external data beside it itself). */
    async modelSource(relative, what) {
      return this.inside(relative, what);
    },
  };
}
