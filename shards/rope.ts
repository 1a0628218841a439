/**
 * Rotary tables, computed once at compile time (in float64) with the checkpoint's rope scaling
 * folded in; the graphs only multiply position_ids by the inverse frequencies (or index caches
 * built from them), then scale cos and sin by HF's attention_scaling.
 */
import { CheckpointError } from './errors.ts'

export interface RopeSpec {
  theta: number
  /** 'default', 'linear', 'llama3', 'yarn' or 'longrope'. */
  type: string
  params: Record<string, unknown>
  /** config.json max_position_embeddings (the extended context for yarn/longrope). */
  maxPositionEmbeddings: number
  /** config.json's top-level original_max_position_embeddings (Phi-3), if any. */
  originalMaxPositionEmbeddings?: number
}

/**
 * What the graphs bake in. LongRoPE's two factor sets are chosen per position: positions below
 * `long.from` (original_max_position_embeddings) rotate with the short factors, positions at or
 * past it with the long ones — HF picks by sequence length (seq_len > original, i.e. the last
 * position ≥ original), and recomputes the whole cache with the long factors when a sequence
 * crosses. Per position keeps every cached key a function of its own prefix and position, which
 * the prefix cache, rollback and the static graphs' in-place KV rely on: identical to HF for every
 * sequence within original_max_position_embeddings, and past it the positions beyond use the
 * long factors as HF's do (keys below it keep the short ones; see shards/DESIGN.md).
 */
export interface Rotary {
  invFreq: Float64Array
  long?: { invFreq: Float64Array, from: number }
  /** HF's attention_scaling (YaRN mscale, LongRoPE attention factor), multiplied into cos and sin; 1 otherwise. */
  scale: number
}

export const SUPPORTED_ROPE_TYPES = ['default', 'linear', 'llama3', 'yarn', 'longrope']

function p (params: Record<string, unknown>, key: string, fallback?: number): number {
  const v = params[key]
  if (typeof v === 'number') return v
  if (fallback !== undefined) return fallback
  throw new CheckpointError(`config.json: rope scaling needs "${key}"`)
}

function factors (params: Record<string, unknown>, key: string, half: number): Float64Array {
  const v = params[key]
  if (!Array.isArray(v) || v.length !== half || !v.every(x => typeof x === 'number' && x > 0)) {
    throw new CheckpointError(`config.json: longrope "${key}" must be ${half} positive numbers (head_dim / 2)`)
  }
  return Float64Array.from(v as number[])
}

/** The inverse frequencies at one position (what both graph forms and the caches compute from). */
export function invFreqAt (r: Rotary, position: number): Float64Array {
  return r.long !== undefined && position >= r.long.from ? r.long.invFreq : r.invFreq
}

export function rotaryOf (headDim: number, rope: RopeSpec): Rotary {
  const half = headDim / 2
  const inv = new Float64Array(half)
  for (let i = 0; i < half; i++) inv[i] = 1 / rope.theta ** ((2 * i) / headDim)
  switch (rope.type) {
    case 'default':
      return { invFreq: inv, scale: 1 }
    case 'linear': {
      const factor = p(rope.params, 'factor')
      return { invFreq: inv.map(f => f / factor), scale: 1 }
    }
    case 'llama3': {
      const factor = p(rope.params, 'factor')
      const low = p(rope.params, 'low_freq_factor', 1)
      const high = p(rope.params, 'high_freq_factor', 4)
      const oldCtx = p(rope.params, 'original_max_position_embeddings', 8192)
      const lowWavelen = oldCtx / low
      const highWavelen = oldCtx / high
      return {
        invFreq: inv.map(f => {
          const wavelen = 2 * Math.PI / f
          if (wavelen < highWavelen) return f
          if (wavelen > lowWavelen) return f / factor
          const smooth = (oldCtx / wavelen - low) / (high - low)
          return (1 - smooth) * f / factor + smooth * f
        }),
        scale: 1,
      }
    }
    case 'yarn':
      return yarn(headDim, rope, inv)
    case 'longrope':
      return longrope(headDim, rope)
    default:
      throw new CheckpointError(`config.json: rope scaling type "${rope.type}" is not supported (supported: ${SUPPORTED_ROPE_TYPES.join(', ')})`)
  }
}

/** YaRN's magnitude correction, 0.1·m·ln(s) + 1 (1 when not extending). */
function yarnMscale (scale: number, m = 1): number {
  return scale <= 1 ? 1 : 0.1 * m * Math.log(scale) + 1
}

/**
 * HF `_compute_yarn_parameters`: per dimension pair, a linear ramp between the dimensions that
 * rotate beta_fast and beta_slow times over the original context blends the extrapolated
 * (unscaled) and interpolated (÷ factor) frequencies; cos/sin are scaled by attention_factor
 * (default mscale(factor), or mscale(factor, mscale) / mscale(factor, mscale_all_dim) as in
 * DeepSeek's configs).
 */
function yarn (headDim: number, rope: RopeSpec, inv: Float64Array): Rotary {
  const { params } = rope
  const original = p(params, 'original_max_position_embeddings', rope.maxPositionEmbeddings)
  const factor = p(params, 'factor', rope.maxPositionEmbeddings / original)
  const mscale = params.mscale
  const mscaleAllDim = params.mscale_all_dim
  let attention = typeof params.attention_factor === 'number' ? params.attention_factor : undefined
  if (attention === undefined) {
    attention = typeof mscale === 'number' && mscale !== 0 && typeof mscaleAllDim === 'number' && mscaleAllDim !== 0
      ? yarnMscale(factor, mscale) / yarnMscale(factor, mscaleAllDim)
      : yarnMscale(factor)
  }
  // `x || default` as HF: an explicit 0 or null also means the default.
  const betaFast = typeof params.beta_fast === 'number' && params.beta_fast !== 0 ? params.beta_fast : 32
  const betaSlow = typeof params.beta_slow === 'number' && params.beta_slow !== 0 ? params.beta_slow : 1
  const truncate = params.truncate !== false
  const correctionDim = (rotations: number): number => (headDim * Math.log(original / (rotations * 2 * Math.PI))) / (2 * Math.log(rope.theta))
  let low = correctionDim(betaFast)
  let high = correctionDim(betaSlow)
  if (truncate) { low = Math.floor(low); high = Math.ceil(high) }
  low = Math.max(low, 0)
  high = Math.min(high, headDim - 1)
  if (low === high) high += 0.001
  const invFreq = inv.map((f, i) => {
    const ramp = Math.min(1, Math.max(0, (i - low) / (high - low)))
    const extrapolation = 1 - ramp
    return (f / factor) * (1 - extrapolation) + f * extrapolation
  })
  return { invFreq, scale: attention }
}

/**
 * HF `_compute_longrope_parameters`: inv_freq = 1 / (ext · θ^(2i/d)) with the short or long
 * factors as ext; attention_factor defaults to sqrt(1 + ln(s) / ln(original)) where Phi-3's s is
 * max_position_embeddings / original_max_position_embeddings (the config-level field), else the
 * block's factor.
 */
function longrope (headDim: number, rope: RopeSpec): Rotary {
  const { params } = rope
  const half = headDim / 2
  const short = factors(params, 'short_factor', half)
  const long = factors(params, 'long_factor', half)
  let original: number
  let factor: number
  if (rope.originalMaxPositionEmbeddings !== undefined) {
    original = rope.originalMaxPositionEmbeddings
    factor = rope.maxPositionEmbeddings / original
  } else if (typeof params.original_max_position_embeddings === 'number') {
    original = params.original_max_position_embeddings
    factor = p(params, 'factor', rope.maxPositionEmbeddings / original)
  } else {
    original = rope.maxPositionEmbeddings
    factor = p(params, 'factor', 1)
  }
  const attention = typeof params.attention_factor === 'number'
    ? params.attention_factor
    : factor <= 1 ? 1 : Math.sqrt(1 + Math.log(factor) / Math.log(original))
  const base = (ext: Float64Array): Float64Array => ext.map((e, i) => 1 / (e * rope.theta ** ((2 * i) / headDim)))
  return { invFreq: base(short), long: { invFreq: base(long), from: original }, scale: attention }
}
