/**
 * Optional integrity against forgery (`checkpoint.signing_key`). A manifest's digest proves its
 * records file is unchanged, not who wrote it: anyone who can write the checkpoint directory can
 * rewrite the records and the digest together. With a key, each manifest carries
 * `"mac": "hmac-sha256:<hex>"`, an HMAC-SHA256 over the manifest's canonical content without the
 * `mac` field. Since the manifest names the records file's digest and count, the MAC covers the
 * records too. The canonical content is the UTF-8 of the manifest as compact JSON with keys sorted
 * at every level (Python: `json.dumps(m, sort_keys=True, separators=(",", ":"),
 * ensure_ascii=False).encode()`), independent of how the file itself is indented.
 */
import { createHmac, timingSafeEqual } from 'node:crypto';

import { CheckpointStateError } from './errors.js';
import { encodeJson } from './json.js';

export const MAC_FIELD = 'mac';
/** The MAC's algorithm, written before its hex, so another algorithm can be told apart later. */
export const MAC_PREFIX = 'hmac-sha256:';
/** The shortest key accepted: HMAC-SHA256 is as strong as its key up to the hash's 32 bytes. */
export const MIN_SIGNING_KEY_BYTES = 32;

const MAC_PATTERN = /^hmac-sha256:([0-9a-f]{64})$/;

/** The key's bytes: the text of `checkpoint.signing_key`, as UTF-8 (no hex or base64 decoding). */
export function signingKeyBytes(text: string): Buffer {
  return Buffer.from(text, 'utf8');
}

/** `hmac-sha256:<hex>` of `value` without its `mac` field. */
export function manifestMac(key: Uint8Array, value: Readonly<Record<string, unknown>>): string {
  return MAC_PREFIX + macBytes(key, value).toString('hex');
}

/** `value` with its `mac` field set (replacing any it had). */
export function signed<T extends Readonly<Record<string, unknown>>>(
  key: Uint8Array,
  value: T,
): T & { mac: string } {
  return { ...value, [MAC_FIELD]: manifestMac(key, value) };
}

/**
 * Refuses a manifest (or any record signed by `signed`) whose MAC is missing, malformed, or not
 * the one `key` makes, with `invalid_checkpoint_state` naming `path` and the rule. The comparison
 * runs in constant time.
 */
export function verifyManifestMac(
  key: Uint8Array,
  value: Readonly<Record<string, unknown>>,
  path: string,
): void {
  const mac = value[MAC_FIELD];
  if (mac === undefined) {
    throw new CheckpointStateError(
      `${path} carries no MAC, and checkpoint.signing_key requires one`,
    );
  }
  const hex = typeof mac === 'string' ? MAC_PATTERN.exec(mac)?.[1] : undefined;
  if (hex === undefined) {
    throw new CheckpointStateError(
      `${path} has a malformed MAC (expected "${MAC_PREFIX}" and 64 hex digits)`,
    );
  }
  if (!timingSafeEqual(Buffer.from(hex, 'hex'), macBytes(key, value))) {
    throw new CheckpointStateError(
      `${path} has a MAC that does not verify with checkpoint.signing_key ` +
        '(its content was changed, or another key signed it)',
    );
  }
}

function macBytes(key: Uint8Array, value: Readonly<Record<string, unknown>>): Buffer {
  const { [MAC_FIELD]: _mac, ...content } = value;
  return createHmac('sha256', key).update(canonicalJson(content), 'utf8').digest();
}

/** Compact JSON with object keys sorted at every level; arrays keep their order. */
function canonicalJson(value: unknown): string {
  if (Array.isArray(value)) return `[${value.map(canonicalJson).join(',')}]`;
  if (value !== null && typeof value === 'object') {
    const object = value as Record<string, unknown>;
    const members = Object.keys(object)
      .sort()
      .map((key) => `${JSON.stringify(key)}:${canonicalJson(object[key])}`);
    return `{${members.join(',')}}`;
  }
  return encodeJson(value);
}
