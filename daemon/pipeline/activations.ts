/**
 * Activation encodings on the stage wire: how a [rows, width] f32 tensor travels between stages.
 *  - f32: raw little-endian f32, 4 bytes a value. Exact; the default.
 *  - f16: IEEE binary16, round to nearest even, 2 bytes a value. Values past ±65504 saturate to
 *    ±65504 (not ±∞, which would poison the next stage's norm); relative error ≤ 2^-11 in the
 *    normal range, absolute ≤ 2^-25 below it.
 *  - int8: per row, an f32 scale s = max|x| / 127, then round(x / s) (half away from zero) as
 *    int8 in −127..127: 1 byte a value plus 4 a row; error ≤ s / 2 per value. A row with a
 *    non-finite value cannot be scaled and is refused.
 * Decoding always yields f32 (what the next stage's graph takes), so only the bytes on the link
 * shrink; the lossy encodings are chosen per chain (OpenBody.activations), never silently.
 */
import { StageWireError } from './errors.ts'

export type ActivationEncoding = 'f32' | 'f16' | 'int8'
export const ACTIVATION_ENCODINGS: readonly ActivationEncoding[] = ['f32', 'f16', 'int8']

/** The activation frame's dtype byte per encoding. */
export const ACTIVATION_DTYPES: Readonly<Record<ActivationEncoding, number>> = { f32: 1, f16: 2, int8: 3 }
export const ENCODING_BY_DTYPE = new Map(Object.entries(ACTIVATION_DTYPES).map(([k, v]) => [v, k as ActivationEncoding]))

/** Tensor bytes of a [rows, width] activation in an encoding. */
export function encodedBytes (encoding: ActivationEncoding, rows: number, width: number): number {
  switch (encoding) {
    case 'f32': return rows * width * 4
    case 'f16': return rows * width * 2
    case 'int8': return rows * 4 + rows * width
  }
}

const F16_MAX = 0x7bff
const f32 = new Float32Array(1)
const u32 = new Uint32Array(f32.buffer)

/** One f32 to binary16 bits, round to nearest even, saturating at ±65504; NaN stays NaN. */
export function toF16Bits (x: number): number {
  f32[0] = x
  const b = u32[0]!
  const sign = (b >>> 16) & 0x8000
  const exp = (b >>> 23) & 0xff
  const mant = b & 0x7fffff
  if (exp === 0xff) return mant !== 0 ? sign | 0x7e00 : sign | F16_MAX
  const e = exp - 112
  if (e >= 0x1f) return sign | F16_MAX
  if (e <= 0) {
    if (e < -10) return sign
    const m = mant | 0x800000
    const shift = 14 - e
    let h = m >>> shift
    const rem = m & ((1 << shift) - 1)
    const mid = 1 << (shift - 1)
    if (rem > mid || (rem === mid && (h & 1) === 1)) h++
    return sign | h
  }
  let h = (e << 10) | (mant >>> 13)
  const rem = mant & 0x1fff
  if (rem > 0x1000 || (rem === 0x1000 && (h & 1) === 1)) h++
  // Rounding up from the largest finite half carries into the infinity pattern: saturate instead.
  return sign | Math.min(h, F16_MAX)
}

let halfTable: Float32Array | undefined
/** All 65536 binary16 values as f32 (256 KiB, built on first use): decoding is one lookup a value. */
function halves (): Float32Array {
  if (halfTable !== undefined) return halfTable
  const t = new Float32Array(65536)
  for (let h = 0; h < 65536; h++) {
    const s = (h & 0x8000) !== 0 ? -1 : 1
    const e = (h >> 10) & 0x1f
    const m = h & 0x3ff
    t[h] = e === 0 ? s * m * 2 ** -24 : e === 31 ? (m !== 0 ? NaN : s * Infinity) : s * (1 + m / 1024) * 2 ** (e - 15)
  }
  halfTable = t
  return t
}

/** Writes `data` in `encoding` into `out` (exactly encodedBytes long). */
export function encodeActivation (encoding: ActivationEncoding, data: Float32Array, rows: number, width: number, out: Uint8Array): void {
  if (out.length !== encodedBytes(encoding, rows, width)) throw new Error('activation buffer has the wrong size')
  switch (encoding) {
    case 'f32':
      out.set(new Uint8Array(data.buffer, data.byteOffset, data.byteLength))
      return
    case 'f16': {
      // The wire is little-endian and so is the host (wire.ts checks): a Uint16Array view when aligned.
      if (out.byteOffset % 2 === 0) {
        const h = new Uint16Array(out.buffer, out.byteOffset, data.length)
        for (let i = 0; i < data.length; i++) h[i] = toF16Bits(data[i]!)
        return
      }
      const dv = new DataView(out.buffer, out.byteOffset, out.byteLength)
      for (let i = 0; i < data.length; i++) dv.setUint16(2 * i, toF16Bits(data[i]!), true)
      return
    }
    case 'int8': {
      const dv = new DataView(out.buffer, out.byteOffset, rows * 4)
      const q = new Int8Array(out.buffer, out.byteOffset + rows * 4, rows * width)
      for (let r = 0; r < rows; r++) {
        const base = r * width
        let max = 0
        for (let i = 0; i < width; i++) max = Math.max(max, Math.abs(data[base + i]!))
        if (!Number.isFinite(max)) throw new StageWireError('SHOAL_ERR_STAGE_MALFORMED', `activation row ${r} has a non-finite value; int8 cannot carry it`)
        const scale = Math.fround(max / 127)
        dv.setFloat32(4 * r, scale, true)
        if (scale === 0) continue // q stays 0 (the buffer is fresh)
        for (let i = 0; i < width; i++) {
          const v = data[base + i]! / scale
          q[base + i] = Math.max(-127, Math.min(127, Math.sign(v) * Math.floor(Math.abs(v) + 0.5)))
        }
      }
    }
  }
}

/** Reads an encoded [rows, width] tensor back as f32 (`bytes` exactly encodedBytes long). */
export function decodeActivation (encoding: ActivationEncoding, bytes: Uint8Array, rows: number, width: number): Float32Array {
  const n = rows * width
  const out = new Float32Array(n)
  switch (encoding) {
    case 'f32':
      new Uint8Array(out.buffer).set(bytes)
      return out
    case 'f16': {
      const t = halves()
      if (bytes.byteOffset % 2 === 0) {
        const h = new Uint16Array(bytes.buffer, bytes.byteOffset, n)
        for (let i = 0; i < n; i++) out[i] = t[h[i]!]!
        return out
      }
      const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength)
      for (let i = 0; i < n; i++) out[i] = t[dv.getUint16(2 * i, true)]!
      return out
    }
    case 'int8': {
      const dv = new DataView(bytes.buffer, bytes.byteOffset, rows * 4)
      const q = new Int8Array(bytes.buffer, bytes.byteOffset + rows * 4, n)
      for (let r = 0; r < rows; r++) {
        const scale = dv.getFloat32(4 * r, true)
        if (!Number.isFinite(scale) || scale < 0) throw new StageWireError('SHOAL_ERR_STAGE_MALFORMED', `int8 activation row ${r} has scale ${scale}`)
        for (let i = r * width; i < (r + 1) * width; i++) out[i] = q[i]! * scale
      }
      return out
    }
  }
}

/**
 * The encoding a chain is opened with: the coordinator's choice when every later stage says it
 * accepts it (`accepts(peerId)`: the lossy encodings its capabilities declare), else f32 — a
 * stage of an older build, or one whose capabilities have not arrived, never receives a dtype it
 * cannot decode. Pure.
 */
export function chainEncoding (requested: ActivationEncoding, stagePeers: readonly string[], accepts: (peerId: string) => readonly string[] | undefined): ActivationEncoding {
  if (requested === 'f32') return 'f32'
  return stagePeers.every(p => accepts(p)?.includes(requested) === true) ? requested : 'f32'
}

/** The lossy encodings this build's stages decode (declared in their capabilities). */
export const ACCEPTED_ENCODINGS: readonly ActivationEncoding[] = ['f16', 'int8']

/** What the receiving stage will see for `data` sent in `encoding` (the sender hashes this for its receipt part). */
export function roundTripActivation (encoding: ActivationEncoding, data: Float32Array, rows: number, width: number): Float32Array {
  if (encoding === 'f32') return data
  const bytes = new Uint8Array(encodedBytes(encoding, rows, width))
  encodeActivation(encoding, data, rows, width, bytes)
  return decodeActivation(encoding, bytes, rows, width)
}
