/**
 * Byte helpers shared by the binary wire formats (routing, pipeline and experts frames): unsigned
 * LEB128 varints, as it-length-prefixed writes them, and the length-prefixed frame as parts.
 * Each protocol keeps its own layout and its own typed errors; only the byte arithmetic lives here.
 */

/** Bytes an unsigned varint of `n` takes. */
export function varintLength (n: number): number {
  let len = 1
  while (n >= 0x80) { n = Math.floor(n / 128); len++ }
  return len
}

/** Writes `n` as an unsigned varint at `offset`; returns the offset after it. */
export function writeVarint (out: Uint8Array, offset: number, n: number): number {
  while (n >= 0x80) { out[offset++] = (n % 128) | 0x80; n = Math.floor(n / 128) }
  out[offset++] = n
  return offset
}

/**
 * A frame as it goes on a stream: its payload parts behind a varint length (the parts are not
 * copied). `tooLarge` makes the protocol's own error when the payload exceeds `maxBytes`.
 */
export function lengthPrefixed (parts: Uint8Array[], maxBytes: number, tooLarge: (bytes: number) => Error): Uint8Array[] {
  const len = parts.reduce((n, p) => n + p.length, 0)
  if (len > maxBytes) throw tooLarge(len)
  const prefix = new Uint8Array(varintLength(len))
  writeVarint(prefix, 0, len)
  return [prefix, ...parts]
}

/** Parts as one contiguous byte array (tests and golden bytes). */
export function joinParts (parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0))
  let o = 0
  for (const p of parts) { out.set(p, o); o += p.length }
  return out
}
