/**
 * Weight quantization into the com.microsoft MatMulNBits layout: per output row, blocks of
 * `blockSize` input elements, each with one f32 scale; symmetric, so no zero_points input (the
 * op's default zero point, 2^(bits-1), applies). 4-bit values pack two per byte, low nibble first.
 * Dequantised weight = (q - 2^(bits-1)) · scale. Symmetric-without-zero-points is the form every
 * OpenVINO ONNX-frontend version we checked reads (see DESIGN.md). 4-bit scales are IEEE halves
 * (stored as f32, as the op wants them): what llama.cpp's Q4_0 keeps too, so shoal's int4 kernel
 * packs them in half the bytes (q4-matmul.h; compiler 14).
 */
import type { Quantization } from './contract.ts'

export interface QuantizedMatrix {
  bits: 4 | 8
  blockSize: number
  /** Output features (rows of the HF weight). */
  n: number
  /** Input features. */
  k: number
  /** [n, blocks, blockSize·bits/8] */
  data: Uint8Array
  /** [n · blocks] */
  scales: Float32Array
}

/** The implicit zero point MatMulNBits uses when none is given. */
export const defaultZeroPoint = (bits: 4 | 8): number => 1 << (bits - 1)

/** Quantizes an HF-layout weight [n, k]; a partial last block is padded with zeros. */
export function quantizeMatrix (w: Float32Array, n: number, k: number, bits: 4 | 8, blockSize: number): QuantizedMatrix {
  const blocks = Math.ceil(k / blockSize)
  const blob = blockSize * bits / 8
  const zp = defaultZeroPoint(bits)
  const qmax = zp - 1
  const data = new Uint8Array(n * blocks * blob)
  const scales = new Float32Array(n * blocks)
  const q = new Uint8Array(blockSize)
  for (let r = 0; r < n; r++) {
    for (let b = 0; b < blocks; b++) {
      const start = b * blockSize
      const end = Math.min(k, start + blockSize)
      let absMax = 0
      for (let i = start; i < end; i++) absMax = Math.max(absMax, Math.abs(w[r * k + i]!))
      const raw = absMax > 0 ? absMax / qmax : 1
      const scale = bits === 4 ? halfScale(raw) : Math.fround(raw)
      for (let i = 0; i < blockSize; i++) {
        const v = start + i < end ? w[r * k + start + i]! : 0
        q[i] = Math.min(qmax, Math.max(-zp, Math.round(v / scale))) + zp
      }
      scales[r * blocks + b] = scale
      const base = (r * blocks + b) * blob
      if (bits === 8) data.set(q, base)
      else for (let i = 0; i < blockSize; i += 2) data[base + i / 2] = q[i]! | (q[i + 1]! << 4)
    }
  }
  return { bits, blockSize, n, k, data, scales }
}

/**
 * A 4-bit block's scale: the nearest IEEE half to `raw` (a block's largest magnitude over 7), so that
 * shoal's int4 kernel may keep it in two bytes and turn it back into the same float. The scale moves
 * by at most 2^-11 of itself, and every weight still dequantises to within half a step of itself (a
 * block's largest may then sit 7 steps and a sliver from zero, clamped to 7). Never 0 for a block
 * that is not all zeros: below the smallest half it is that half, 2^-24.
 */
function halfScale (raw: number): number {
  const h = roundToHalf(raw)
  return h === 0 ? 2 ** -24 : h
}

/**
 * x rounded to the nearest IEEE half-precision value (ties to even), as a number; past the largest
 * finite half (65,504), that half. The same as Math.f16round where the runtime has it (Node ≥ 24),
 * infinities apart. (daemon/pipeline/activations.ts toF16Bits rounds an f32 to a half's bits for
 * the wire; the compiler sits below the daemon and rounds the quotient itself, once.)
 */
export function roundToHalf (x: number): number {
  if (Number.isNaN(x) || x === 0) return x
  const a = Math.abs(x)
  // 65,520 and above would round to infinity.
  if (a >= 65520) return Math.sign(x) * 65504
  let e = Math.floor(Math.log2(a))
  if (2 ** e > a) e--
  else if (2 ** (e + 1) <= a) e++
  // A half's unit in the last place at a's binade (ten significand bits; subnormals below 2^-14).
  const ulp = 2 ** (Math.max(e, -14) - 10)
  const units = a / ulp
  const whole = Math.floor(units)
  const rest = units - whole
  const rounded = rest > 0.5 || (rest === 0.5 && whole % 2 === 1) ? whole + 1 : whole
  return Math.sign(x) * rounded * ulp
}

/** Inverse of quantizeMatrix (for tests and error reports): [n, k] f32. */
export function dequantizeMatrix (q: QuantizedMatrix): Float32Array {
  const blocks = Math.ceil(q.k / q.blockSize)
  const blob = q.blockSize * q.bits / 8
  const zp = defaultZeroPoint(q.bits)
  const out = new Float32Array(q.n * q.k)
  for (let r = 0; r < q.n; r++) {
    for (let i = 0; i < q.k; i++) {
      const b = Math.floor(i / q.blockSize)
      const j = i % q.blockSize
      const byte = q.data[(r * blocks + b) * blob + (q.bits === 8 ? j : j >> 1)]!
      const v = q.bits === 8 ? byte : (j & 1) === 0 ? byte & 15 : byte >> 4
      out[r * q.k + i] = Math.fround((v - zp) * q.scales[r * blocks + b]!)
    }
  }
  return out
}

/**
 * Whether int4 shards store the token embedding as 4-bit blocks (graph/blocks.ts makeEmbedding) rather
 * than f32: asked for (the default), and the hidden size a whole number of blocks — a row is
 * looked up as [hidden/block] whole blocks with no padding, so a zero-padded partial block would
 * lengthen the looked-up row. int8 shards keep f32 (not measured; int4 is where
 * the embedding is most of the weight bytes).
 */
export function embeddingStorage (kind: 'none' | 'int8' | 'int4', requested: 'int4' | 'f32', hiddenSize: number, blockSize: number): 'int4' | 'f32' {
  return kind === 'int4' && requested === 'int4' && hiddenSize % blockSize === 0 ? 'int4' : 'f32'
}

/** What a compile is asked for: the quantization options compileShards and compileExpertShards share. */
export interface QuantizationRequest {
  quant?: 'none' | 'int8' | 'int4'
  blockSize?: 32 | 128
  accuracyLevel?: 0 | 4
  embedding?: 'int4' | 'f32'
  /** The benchmark's int4 kernel (Quantization.kernel): int4, block 32, accuracy level 4 only. */
  kernel?: 'native'
}

/**
 * The manifest's `quantization` for a compile request, with the defaults filled in (block 32,
 * int8 activations, the 4-bit embedding where it fits). One function for both compilers, so
 * expert-parallel and one-graph shards of one checkpoint quantize alike and pick the same tokens.
 */
export function quantizationOf (request: QuantizationRequest, hiddenSize: number): Quantization {
  const kind = request.quant ?? 'none'
  if (kind === 'none') return { kind: 'none' }
  const blockSize = request.blockSize ?? 32
  return {
    kind,
    blockSize,
    activations: request.accuracyLevel === 0 ? 'f32' : 'int8',
    ...(kind === 'int4' ? { embedding: embeddingStorage(kind, request.embedding ?? 'int4', hiddenSize, blockSize) } : {}),
    ...(request.kernel === undefined ? {} : { kernel: request.kernel }),
  }
}
