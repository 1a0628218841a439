/**
 * One step of a MoE layer whose experts live on holder nodes: which rows go to which holder
 * (dispatchRows), how big one expert is (expertBytes), and how the holders' answers combine
 * (combinePartials). Pure functions; the stage node gathers the router's choices, carries out the
 * dispatch over /shoal/experts/2.0.0 (wire.ts) and combines.
 */
import type { ModelShape, Quantization } from '../../shards/index.ts'
import type { LayerPlacement } from './placement.ts'

/** One row's router choice: its top-k experts and their weights (after any renormalisation). */
export interface RowRoute {
  experts: number[]
  weights: number[]
}

/** What one holder computes for a step: for each of its experts, the rows (ascending) and weights. */
export interface HolderWork {
  peerId: string
  /** Experts ascending; rows index the step's rows. */
  groups: Array<{ expert: number, rows: number[], weights: number[] }>
  /** The step's rows this holder needs, ascending (the union of its groups' rows). */
  rows: number[]
}

export type DispatchDecision =
  | { kind: 'dispatch', work: HolderWork[] }
  /** Every holder of a chosen expert is excluded (dead): the step cannot run; the request replays. */
  | { kind: 'lost', layer: number, expert: number, holders: string[] }

export interface DispatchOptions {
  /** Holders to avoid (suspect or gone); their replicas take over. */
  exclude?: ReadonlySet<string>
  /** Rotates which replica takes which rows, so successive steps spread evenly (e.g. the step number). */
  salt?: number
}

/**
 * Groups a step's rows by holder. A replicated expert's rows alternate between its live copies
 * (row j of the expert's rows goes to copy (j + salt) mod copies), so each copy gets an even
 * share; an expert with no rows this step costs no message at all.
 */
export function dispatchRows (placement: LayerPlacement, routes: RowRoute[], options: DispatchOptions = {}): DispatchDecision {
  const E = placement.holders.length
  const perExpert = Array.from({ length: E }, () => ({ rows: [] as number[], weights: [] as number[] }))
  routes.forEach((r, row) => {
    if (r.experts.length !== r.weights.length) throw new RangeError(`row ${row}: ${r.experts.length} experts, ${r.weights.length} weights`)
    r.experts.forEach((e, j) => {
      if (!Number.isInteger(e) || e < 0 || e >= E) throw new RangeError(`row ${row}: expert ${e} of ${E}`)
      perExpert[e]!.rows.push(row)
      perExpert[e]!.weights.push(r.weights[j]!)
    })
  })
  const byHolder = new Map<string, HolderWork>()
  const salt = options.salt ?? 0
  for (const [expert, { rows, weights }] of perExpert.entries()) {
    if (rows.length === 0) continue
    const all = placement.holders[expert]!
    const live = options.exclude === undefined ? all : all.filter(h => !options.exclude!.has(h))
    if (live.length === 0) return { kind: 'lost', layer: placement.layer, expert, holders: all }
    rows.forEach((row, j) => {
      const peerId = live[(j + salt) % live.length]!
      let w = byHolder.get(peerId)
      if (w === undefined) { w = { peerId, groups: [], rows: [] }; byHolder.set(peerId, w) }
      let g = w.groups[w.groups.length - 1]
      if (g === undefined || g.expert !== expert) { g = { expert, rows: [], weights: [] }; w.groups.push(g) }
      g.rows.push(row)
      g.weights.push(weights[j]!)
    })
  }
  const work = [...byHolder.values()]
  for (const w of work) w.rows = [...new Set(w.groups.flatMap(g => g.rows))].sort((a, b) => a - b)
  // Holders in the order of their lowest expert, so the combine order is fixed by the plan.
  work.sort((a, b) => a.groups[0]!.expert - b.groups[0]!.expert || (a.peerId < b.peerId ? -1 : 1))
  return { kind: 'dispatch', work }
}

/**
 * The routed output of a step, [rows × width]: each holder's answer holds Σ weight · expert(row)
 * over its experts for each of its rows (HolderWork.rows order); they are added in the dispatch's
 * holder order. The stage adds the shared expert and the residual after this.
 */
export function combinePartials (rows: number, width: number, work: HolderWork[], partials: Float32Array[]): Float32Array {
  const out = new Float32Array(rows * width)
  work.forEach((w, h) => {
    const p = partials[h]!
    if (p.length !== w.rows.length * width) throw new RangeError(`holder ${w.peerId}: ${p.length} values for ${w.rows.length} rows × ${width}`)
    w.rows.forEach((row, j) => {
      for (let d = 0; d < width; d++) out[row * width + d]! += p[j * width + d]!
    })
  })
  return out
}

/**
 * Resident bytes of one expert (fused gate/up [2I, D] and down [D, I]) in a shard of the given
 * quantization: f32, or MatMulNBits blocks plus one f32 scale per block (shards/quant.ts).
 */
export function expertBytes (shape: Pick<ModelShape, 'hiddenSize' | 'moe'>, quantization: Quantization): number {
  if (shape.moe === undefined) throw new RangeError('expertBytes: not a mixture-of-experts model')
  const D = shape.hiddenSize
  const I = shape.moe.expertIntermediateSize
  const matrix = (n: number, k: number): number => {
    if (quantization.kind === 'none') return n * k * 4
    const bits = quantization.kind === 'int4' ? 4 : 8
    const blocks = Math.ceil(k / quantization.blockSize)
    return n * blocks * (quantization.blockSize * bits / 8) + n * blocks * 4
  }
  return matrix(2 * I, D) + matrix(D, I)
}
