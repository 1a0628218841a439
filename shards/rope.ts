/**
 * Rotary inverse frequencies, computed once at compile time (in float64) with the checkpoint's
 * rope scaling folded in; the graphs only multiply position_ids by them.
 */
import { CheckpointError } from './errors.ts'

export interface RopeSpec {
  theta: number
  /** 'default', 'linear' or 'llama3'. */
  type: string
  params: Record<string, unknown>
}

export const SUPPORTED_ROPE_TYPES = ['default', 'linear', 'llama3']

function p (params: Record<string, unknown>, key: string, fallback?: number): number {
  const v = params[key]
  if (typeof v === 'number') return v
  if (fallback !== undefined) return fallback
  throw new CheckpointError(`config.json: rope scaling needs "${key}"`)
}

export function ropeInvFreq (headDim: number, rope: RopeSpec): Float64Array {
  const half = headDim / 2
  const inv = new Float64Array(half)
  for (let i = 0; i < half; i++) inv[i] = 1 / rope.theta ** ((2 * i) / headDim)
  switch (rope.type) {
    case 'default':
      return inv
    case 'linear': {
      const factor = p(rope.params, 'factor')
      return inv.map(f => f / factor)
    }
    case 'llama3': {
      const factor = p(rope.params, 'factor')
      const low = p(rope.params, 'low_freq_factor', 1)
      const high = p(rope.params, 'high_freq_factor', 4)
      const oldCtx = p(rope.params, 'original_max_position_embeddings', 8192)
      const lowWavelen = oldCtx / low
      const highWavelen = oldCtx / high
      return inv.map(f => {
        const wavelen = 2 * Math.PI / f
        if (wavelen < highWavelen) return f
        if (wavelen > lowWavelen) return f / factor
        const smooth = (oldCtx / wavelen - low) / (high - low)
        return (1 - smooth) * f / factor + smooth * f
      })
    }
    default:
      throw new CheckpointError(`config.json: rope scaling type "${rope.type}" is not supported (supported: ${SUPPORTED_ROPE_TYPES.join(', ')})`)
  }
}
