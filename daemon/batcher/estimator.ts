/**
 * Step time from history, for the expected wait that admission and the load record use.
 *
 * Model: ms ≈ fixed + perSequence × sequences + perToken × positions, fitted by exponentially
 * weighted least squares (recent runs count most). A few prior pseudo-runs with a small constant
 * weight keep the fit solvable when history is one-dimensional (decodes only, where positions =
 * sequences) and let the prior speak for shapes never seen; real runs outweigh them quickly.
 */
import type { StepCostModel } from './types.ts'

export interface StepTimeEstimator {
  observe (sequences: number, tokens: number, ms: number): void
  /** Expected run time in ms (≥ 0). */
  estimate (sequences: number, tokens: number): number
  model (): StepCostModel
}

export interface EstimatorOptions {
  /** Weight of the newest run (older ones decay by 1 − alpha per run). */
  alpha?: number
  /** Weight of each prior pseudo-run. */
  priorWeight?: number
}

type Vec3 = [number, number, number]
type Mat3 = [Vec3, Vec3, Vec3]

export function createStepTimeEstimator (prior: StepCostModel, options: EstimatorOptions = {}): StepTimeEstimator {
  const alpha = options.alpha ?? 0.1
  const priorWeight = options.priorWeight ?? 0.002
  const xtx: Mat3 = [[0, 0, 0], [0, 0, 0], [0, 0, 0]]
  const xty: Vec3 = [0, 0, 0]
  const priorXtx: Mat3 = [[0, 0, 0], [0, 0, 0], [0, 0, 0]]
  const priorXty: Vec3 = [0, 0, 0]
  // The system solved at each run, and its solution: kept, not rebuilt, since a batcher observes
  // every run it times (one a decoded token for one stream) and this runs on the event loop.
  const a: Mat3 = [[0, 0, 0], [0, 0, 0], [0, 0, 0]]
  const b: Vec3 = [0, 0, 0]
  const theta: Vec3 = [0, 0, 0]
  const predict = (m: StepCostModel, s: number, t: number): number => m.fixedMs + m.perSequenceMs * s + m.perTokenMs * t
  for (const [s, t] of [[1, 1], [8, 8], [1, 256]] as const) accumulate(priorXtx, priorXty, s, t, predict(prior, s, t), priorWeight)
  const fitted: StepCostModel = { ...prior }

  return {
    observe (sequences, tokens, ms) {
      if (!Number.isFinite(ms) || ms < 0) return
      for (let i = 0; i < 3; i++) {
        xty[i]! *= 1 - alpha
        for (let j = 0; j < 3; j++) xtx[i]![j]! *= 1 - alpha
      }
      accumulate(xtx, xty, sequences, tokens, ms, 1)
      for (let i = 0; i < 3; i++) {
        b[i] = xty[i]! + priorXty[i]!
        for (let j = 0; j < 3; j++) a[i]![j] = xtx[i]![j]! + priorXtx[i]![j]!
      }
      if (solve3(a, b, theta)) {
        fitted.fixedMs = theta[0]
        fitted.perSequenceMs = theta[1]
        fitted.perTokenMs = theta[2]
      }
    },
    estimate (sequences, tokens) {
      return sequences <= 0 ? 0 : Math.max(0, predict(fitted, sequences, tokens))
    },
    model () { return { ...fitted } },
  }
}

/** Adds one run, x = [1, sequences, tokens], of weight w to the normal equations. */
function accumulate (m: Mat3, v: Vec3, sequences: number, tokens: number, y: number, w: number): void {
  for (let i = 0; i < 3; i++) {
    const xi = i === 0 ? 1 : i === 1 ? sequences : tokens
    v[i]! += w * xi * y
    for (let j = 0; j < 3; j++) m[i]![j]! += w * xi * (j === 0 ? 1 : j === 1 ? sequences : tokens)
  }
}

function det3 (a00: number, a01: number, a02: number, a10: number, a11: number, a12: number, a20: number, a21: number, a22: number): number {
  return a00 * (a11 * a22 - a12 * a21) - a01 * (a10 * a22 - a12 * a20) + a02 * (a10 * a21 - a11 * a20)
}

/** Cramer's rule into `out`; false (out untouched) when (numerically) singular. */
function solve3 (a: Mat3, b: Vec3, out: Vec3): boolean {
  const r0 = a[0]; const r1 = a[1]; const r2 = a[2]
  const a00 = r0[0]; const a01 = r0[1]; const a02 = r0[2]
  const a10 = r1[0]; const a11 = r1[1]; const a12 = r1[2]
  const a20 = r2[0]; const a21 = r2[1]; const a22 = r2[2]
  const b0 = b[0]; const b1 = b[1]; const b2 = b[2]
  const d = det3(a00, a01, a02, a10, a11, a12, a20, a21, a22)
  if (!Number.isFinite(d) || Math.abs(d) < 1e-12) return false
  out[0] = det3(b0, a01, a02, b1, a11, a12, b2, a21, a22) / d
  out[1] = det3(a00, b0, a02, a10, b1, a12, a20, b2, a22) / d
  out[2] = det3(a00, a01, b0, a10, a11, b1, a20, a21, b2) / d
  return true
}

/**
 * Decode-run time by row count: one average for each count seen, read at the count asked, else
 * interpolated between the nearest counts measured on either side, else carried on along the line
 * through the two nearest measured counts (never below 0, never past the nearest one downwards).
 *
 * Why not the linear model above for decodes: after a burst of eight streams its data are
 * eight-row runs and a few runs of 2–7 rows that repack their KV as the batch changes (15–30 ms
 * where eight rows take 5), and the line it fits, carried to one row, swung between 2 and 28 ms
 * for a 1.7 ms step (docs/engine-notes.md, wave 25). A count's own average moves only with its own
 * runs, and a run past OUTLIER_FACTOR × its count's average (after SETTLED runs) counts as that.
 */
export interface DecodeTimeTable {
  observe (rows: number, ms: number): void
  /** Expected ms of a decode run of `rows` rows; undefined until two counts (or `rows` itself) are measured. */
  estimate (rows: number): number | undefined
}

const OUTLIER_FACTOR = 2
const SETTLED = 4

export function createDecodeTimeTable (alpha = 0.1): DecodeTimeTable {
  const cells = new Map<number, { avg: number, n: number }>()
  return {
    observe (rows, ms) {
      if (!(rows >= 1) || !Number.isFinite(ms) || ms < 0) return
      const c = cells.get(rows)
      if (c === undefined) { cells.set(rows, { avg: ms, n: 1 }); return }
      const x = c.n >= SETTLED ? Math.min(ms, OUTLIER_FACTOR * c.avg) : ms
      // A plain mean over the first runs, then exponentially weighted.
      c.avg += Math.max(alpha, 1 / (c.n + 1)) * (x - c.avg)
      c.n++
    },
    estimate (rows) {
      const own = cells.get(rows)
      if (own !== undefined) return own.avg
      const counts = [...cells.keys()].sort((a, b) => a - b)
      const below = counts.filter(r => r < rows)
      const above = counts.filter(r => r > rows)
      const at = (r: number): number => cells.get(r)!.avg
      const line = (a: number, b: number): number => at(a) + (at(b) - at(a)) * (rows - a) / (b - a)
      if (below.length > 0 && above.length > 0) return line(below.at(-1)!, above[0]!)
      if (below.length >= 2) return Math.max(at(below.at(-1)!), line(below.at(-2)!, below.at(-1)!))
      if (above.length >= 2) return Math.max(0, Math.min(at(above[0]!), line(above[0]!, above[1]!)))
      return undefined
    },
  }
}

/** Events per second over the recent past: a counter that decays with time constant `tauMs`. */
export interface RateMeter {
  add (count: number, now: number): void
  perSecond (now: number): number
}

export function createRateMeter (tauMs = 5_000): RateMeter {
  let value = 0
  let at = 0
  const decayTo = (now: number): void => {
    if (now > at) { value *= Math.exp(-(now - at) / tauMs); at = now }
  }
  return {
    add (count, now) { decayTo(now); value += count },
    perSecond (now) { decayTo(now); return value * 1000 / tauMs },
  }
}
