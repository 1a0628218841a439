/**
 * Stage planning, a pure function: even splits (--stages N) or explicit ranges (--layers), each
 * checked to cover every layer exactly once, in order.
 */
import { LayerSplitError } from './errors.ts'

export function planStages (numLayers: number, opts: { stages?: number, layers?: Array<[number, number]> }): Array<[number, number]> {
  if (opts.layers !== undefined && opts.stages !== undefined && opts.stages !== opts.layers.length) {
    throw new LayerSplitError(`--stages ${opts.stages} disagrees with ${opts.layers.length} explicit layer ranges`)
  }
  if (opts.layers !== undefined) {
    const ranges = opts.layers
    if (ranges.length === 0) throw new LayerSplitError('no layer ranges given')
    let next = 0
    for (const [a, b] of ranges) {
      if (!Number.isInteger(a) || !Number.isInteger(b) || b < a) throw new LayerSplitError(`bad layer range ${a}-${b}`)
      if (a !== next) {
        throw new LayerSplitError(a < next
          ? `layer ${a} is covered twice (ranges must not overlap)`
          : `layers ${next}-${a - 1} are not covered by any stage`)
      }
      next = b + 1
    }
    if (next !== numLayers) {
      throw new LayerSplitError(next < numLayers
        ? `layers ${next}-${numLayers - 1} are not covered by any stage`
        : `ranges reach layer ${next - 1} but the model has only ${numLayers} layers (0-${numLayers - 1})`)
    }
    return ranges.map(([a, b]) => [a, b])
  }
  const n = opts.stages ?? 1
  if (!Number.isInteger(n) || n < 1) throw new LayerSplitError(`--stages must be a positive integer, got ${n}`)
  if (n > numLayers) throw new LayerSplitError(`cannot split ${numLayers} layers into ${n} stages`)
  const out: Array<[number, number]> = []
  let start = 0
  for (let i = 0; i < n; i++) {
    // Earlier stages take the remainder: stage 0 also holds the embedding lookup (cheap), the last the lm_head (not).
    const size = Math.floor(numLayers / n) + (i < numLayers % n ? 1 : 0)
    out.push([start, start + size - 1])
    start += size
  }
  return out
}

/** Parses "0-11,12-23" (a single number means a one-layer range). */
export function parseLayerRanges (text: string): Array<[number, number]> {
  return text.split(',').map(part => {
    const m = /^\s*(\d+)\s*(?:-\s*(\d+))?\s*$/.exec(part)
    if (m === null) throw new LayerSplitError(`bad layer range "${part}" (expected e.g. 0-11,12-23)`)
    const a = Number(m[1])
    return [a, m[2] === undefined ? a : Number(m[2])]
  })
}
