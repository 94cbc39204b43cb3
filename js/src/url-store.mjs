// An artifact served over HTTP (a browser's fetch). There are no symbolic links to follow: a file name is
// checked as written, and the URL it makes must stay under the artifact's URL.

import { ArtifactError, repr } from "./format.mjs";

function checkRelative(relative, what, root) {
  if (typeof relative !== "string" || !relative) {
    throw new ArtifactError(`${what} must be a file name inside the artifact directory, got ${repr(relative)}`);
  }
  const parts = relative.split(/[\\/]/);
  if (relative.startsWith("/") || relative.startsWith("\\") || /^[A-Za-z]:/.test(relative) || parts.includes("..") ||
      /^[A-Za-z][A-Za-z0-9+.-]*:/.test(relative) || relative.includes("?") || relative.includes("#") ||
      /%2e|%2f|%5c/i.test(relative)) {
    throw new ArtifactError(`${what} is ${repr(relative)}, which points outside the artifact directory ${root}`);
  }
}

export function urlStore(url, { fetch: fetchFn = globalThis.fetch } = {}) {
  const base = new URL(String(url).endsWith("/") ? String(url) : `${url}/`, globalThis.location?.href);
  const cache = new Map();
  const get = async (href) => {
    if (!cache.has(href)) {
      const response = await fetchFn(href);
      if (response.status === 404 || response.status === 410) cache.set(href, null);
      else if (!response.ok) throw new ArtifactError(`${href} cannot be fetched: HTTP ${response.status}`);
      else cache.set(href, new Uint8Array(await response.arrayBuffer()));
    }
    return cache.get(href);
  };
  return {
    root: base.href.replace(/\/$/, ""),
    display: (relative) => new URL(relative, base).href,
    async isDirectory() {
      return true; // a URL names no directory to look at; a missing signature.json says what is wrong
    },
    inside(relative, what, dir = "") {
      const from = new URL(dir ? `${dir}/` : "", base);
      checkRelative(relative, what, from.href);
      const href = new URL(relative, from).href;
      if (!href.startsWith(from.href)) {
        throw new ArtifactError(`${what} is ${repr(relative)}, which resolves to ${href}, outside the artifact directory ${from.href}`);
      }
      return href;
    },
    async exists(relative, what, dir = "") {
      return (await get(this.inside(relative, what, dir))) !== null;
    },
    async read(relative, what, dir = "") {
      const bytes = await get(this.inside(relative, what, dir));
      if (bytes === null) throw new ArtifactError(`${this.inside(relative, what, dir)} is missing`);
      return bytes;
    },
    /** What ONNX Runtime opens: the model's bytes (its external data goes in the session options). */
    async modelSource(relative, what) {
      return this.read(relative, what);
    },
  };
}
